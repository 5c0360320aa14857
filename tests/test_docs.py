"""Every ```python block of the docs and the README runs (the docs cannot drift).

Each page is one test: its ```python blocks run in order in ONE fresh namespace, so a
page can build on its earlier blocks, exactly as a reader pasting them would. Two
HTML comments, on the line just before a fence, change what happens to it:

- `<!-- skip-test -->` before a ```python block: the block is not run. Use it
  sparingly (shell-like or deliberately incomplete content only).
- `<!-- expected-output -->` before a ```text block: the block must appear in what
  the page's previous ```python block printed (whitespace-normalised), so quoted
  output (an error message of JAX, a shape) is checked, not just copied.

Tracebacks point at the Markdown file and line of the failing block.

A second test checks that every public name of `eqx_ensemble` has an API page
(a `::: eqx_ensemble.name` directive under docs/api/) and that every page under
docs/ is in the mkdocs nav, so a new public name cannot ship undocumented.
"""

import contextlib
import dataclasses
import inspect
import io
import re
from pathlib import Path

import pytest

import eqx_ensemble as ee

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARKER = "<!-- skip-test -->"
OUTPUT_MARKER = "<!-- expected-output -->"
_OPEN = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclasses.dataclass
class Block:
    lang: str
    source: str
    line: int  # 1-based line of the first line of code (after the fence)
    marker: str  # the stripped line just before the opening fence


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown page, dedented to their fence."""
    lines = text.splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = _OPEN.match(lines[index])
        if opening is None:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        marker = lines[index - 1].strip() if index > 0 else ""
        body = []
        index += 1
        while index < len(lines) and not (
            lines[index].strip().startswith(fence)
            and lines[index].strip().strip(fence[0]) == ""
        ):
            line = lines[index]
            body.append(line[len(indent) :] if line.startswith(indent) else line)
            index += 1
        if index == len(lines):
            raise ValueError(f"unclosed code fence opened on line {index}")
        start = index - len(body) + 1
        blocks.append(Block(opening["lang"], "\n".join(body) + "\n", start, marker))
        index += 1
    return blocks


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _normalise(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("page", _pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_page_code_runs(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a page writes land in a scratch folder
    namespace: dict = {"__name__": "__docs__"}
    printed = None
    for block in parse_blocks(page.read_text()):
        if block.lang == "python" and block.marker != SKIP_MARKER:
            # Pad so tracebacks report the Markdown line numbers.
            code = compile("\n" * (block.line - 1) + block.source, str(page), "exec")
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                exec(code, namespace)
            printed = stdout.getvalue()
        elif block.marker == OUTPUT_MARKER:
            assert printed is not None, (
                f"{page.name}:{block.line}: expected output with no python block "
                "before it"
            )
            assert _normalise(block.source) in _normalise(printed), (
                f"{page.name}:{block.line}: the quoted output is not what the code "
                f"printed.\n--- quoted ---\n{block.source}--- printed ---\n{printed}"
            )


def test_parser_finds_blocks_markers_and_indented_fences():
    text = (
        "Text\n"
        "```python\nx = 1\n```\n"
        "<!-- skip-test -->\n"
        "```python\nraise SystemExit\n```\n"
        "!!! note\n"
        "    ```python\n"
        "    if x:\n"
        "        y = 2\n"
        "    ```\n"
        "````text\n```\ninner\n````\n"
    )
    blocks = parse_blocks(text)
    assert [b.lang for b in blocks] == ["python", "python", "python", "text"]
    assert blocks[0].source == "x = 1\n" and blocks[0].line == 3
    assert blocks[1].marker == SKIP_MARKER
    assert blocks[2].source == "if x:\n    y = 2\n" and blocks[2].line == 11
    assert blocks[3].source == "```\ninner\n"


def _calls(text: str, name: str) -> list[str]:
    """The argument text of every call `name(...)` in `text` (to its matching
    parenthesis, or the end of `text` for an elided call)."""
    calls = []
    for match in re.finditer(rf"(?<![\w.]){name}\(|(?<=\.){name}\(", text):
        depth, index = 1, match.end()
        while index < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[index], 0)
            index += 1
        calls.append(text[match.end() : index - 1 if depth == 0 else index])
    return calls


def _top_level_keywords(arguments: str) -> set[str]:
    """The keywords given at the top level of a call's argument text."""
    depth, flat = 0, []
    for char in arguments:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        flat.append(char if depth == 0 else " ")
    return set(re.findall(r"(?<![\w.=])(\w+)\s*=(?!=)", "".join(flat)))


def _moved_keywords() -> dict[str, set[str]]:
    from eqx_ensemble._execution.execution import MOVED_TO_EXECUTION
    from eqx_ensemble._training.fit import _MOVED

    return {
        "fit": set(_MOVED),
        "make_step": set(MOVED_TO_EXECUTION),
        "predict": {"layout"},
        "map": {"layout"},
    }


def test_no_page_writes_a_keyword_the_library_no_longer_takes():
    # The executed blocks would raise; this covers what is not executed: the
    # prose's inline code and the blocks marked skip-test (issue 47, item 10).
    assert _top_level_keywords("x, mesh=m, execution=ee.Execution(mesh=m)") == {
        "mesh",
        "execution",
    }
    moved = _moved_keywords()
    found = []
    for page in _pages():
        if page.name == "changelog.md":  # names what was removed, by design
            continue
        text = page.read_text()
        blocks = parse_blocks(text)
        unexecuted = [b.source for b in blocks if b.marker == SKIP_MARKER]
        prose = re.sub(r"^(`{3,}|~{3,}).*?^\1", "", text, flags=re.M | re.S)
        spans = re.findall(r"`([^`\n]+)`", prose)
        for snippet in [*unexecuted, *spans]:
            for function, names in moved.items():
                for arguments in _calls(snippet, function):
                    for name in sorted(_top_level_keywords(arguments) & names):
                        found.append(f"{page.relative_to(ROOT)}: {function}({name}=)")
    assert not found, f"removed keywords written in the docs: {found}"


def test_docs_have_code_to_run():
    python_blocks = [
        block
        for page in _pages()
        for block in parse_blocks(page.read_text())
        if block.lang == "python"
    ]
    skipped = [block for block in python_blocks if block.marker == SKIP_MARKER]
    assert len(python_blocks) >= 10
    assert len(skipped) <= len(python_blocks) // 10, "skip markers are for exceptions"


def _public_names() -> list[str]:
    names = []
    for name, value in vars(ee).items():
        if name.startswith("_"):
            continue
        if inspect.ismodule(value):
            if value.__name__.startswith("eqx_ensemble."):
                names.append(name)
            continue
        if (getattr(value, "__module__", "") or "").startswith("eqx_ensemble"):
            names.append(name)
    return sorted(names)


def test_every_public_name_has_an_api_page():
    documented = set()
    for page in sorted((DOCS / "api").glob("*.md")):
        documented |= set(
            re.findall(r"^:::\s*eqx_ensemble\.([\w.]+)", page.read_text(), re.M)
        )
    missing = [name for name in _public_names() if name not in documented]
    assert not missing, (
        f"public names without an API page: {missing}; add `::: eqx_ensemble.<name>` "
        "to a page under docs/api/ (and the page to the nav of mkdocs.yml)"
    )


def test_every_docs_page_is_in_the_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"([\w./-]+\.md)\s*$", nav, re.M))
    pages = {str(page.relative_to(DOCS)) for page in DOCS.rglob("*.md")}
    assert listed <= pages, f"nav entries without a page: {sorted(listed - pages)}"
    assert pages <= listed, f"pages missing from the nav: {sorted(pages - listed)}"
