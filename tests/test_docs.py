"""Every ```python block of the docs and the README runs (the docs cannot drift).

The executed pages: `_docs_pages.py` (how a page runs, its markers); the long
guides run in `test_docs_training.py`, `test_docs_methods.py` and
`test_docs_scale.py`, every other page here.

The other tests check that every public name of `eqx_ensemble` has an API page
(a `::: eqx_ensemble.name` directive under docs/api/) and that every page under
docs/ is in the mkdocs nav, so a new public name cannot ship undocumented.
"""

import inspect
import re
from pathlib import Path

import pytest
from _docs_pages import (
    DOCS,
    GROUPS,
    PART_MARKER,
    ROOT,
    SKIP_MARKER,
    PagePart,
    group_pages,
    pages,
    parse_blocks,
    run_page,
)

import eqx_ensemble as ee


@pytest.mark.parametrize("page", group_pages(None))
def test_page_code_runs(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a page writes land in a scratch folder
    run_page(page)


def test_every_long_guide_is_a_page():
    guides = {page.name for page in (DOCS / "guides").glob("*.md")}
    for group, names in GROUPS.items():
        assert set(names) <= guides, f"{group}: no such guide {set(names) - guides}"


def test_a_page_part_runs_the_setup_then_only_its_own_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nseen = ['setup']\n```\n"
        f"{PART_MARKER}\n## One\n"
        "```python\nseen.append('one')\nprint(seen)\n```\n"
        "<!-- expected-output -->\n```text\n['setup', 'one']\n```\n"
        f"{PART_MARKER}\n## Two\n"
        "```python\nseen.append('two')\nprint(seen)\n```\n"
        "<!-- expected-output -->\n```text\n['setup', 'two']\n```\n"
    )
    for part in (0, 1, 2):
        run_page(PagePart(page, part))
    with pytest.raises(AssertionError, match="not what the code printed"):
        run_page(page)  # the whole page in one namespace: part 2 sees 'one'


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
    for page in pages():
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
        for page in pages()
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
