"""The docs pages' executed examples, shared by the `test_docs*.py` files.

Each page is one test: its ```python blocks run in order in ONE fresh namespace, so a
page can build on its earlier blocks, exactly as a reader pasting them would. Two
HTML comments, on the line just before a fence, change what happens to it:

- `<!-- skip-test -->` before a ```python block: the block is not run. Use it
  sparingly (shell-like or deliberately incomplete content only).
- `<!-- expected-output -->` before a ```text block: the block must appear in what
  the page's previous ```python block printed (whitespace-normalised), so quoted
  output (an error message of JAX, a shape) is checked, not just copied.

A long page can be split into tests that run in parallel: a line
`<!-- test-part -->` (before a section that needs only the page's opening
blocks) starts a part. Part 0 is everything before the first such line; each
later part is a test of its own that runs part 0's blocks, then its own, in one
fresh namespace: what a reader pasting the setup and then that section runs.

Tracebacks point at the Markdown file and line of the failing block. The pages
are spread over several test files (`GROUPS`), each under a minute on two cores;
a page no group names runs in `test_docs.py`.
"""

import contextlib
import dataclasses
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SKIP_MARKER = "<!-- skip-test -->"
PART_MARKER = "<!-- test-part -->"
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


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def normalise(text: str) -> str:
    return " ".join(text.split())


# The pages of the long guides, by test file (the rest: test_docs.py).
GROUPS = {
    "training": ("training.md", "fit.md", "data-and-logging.md"),
    "methods": ("methods.md", "architectures.md", "bayesian.md", "sweeps.md"),
    "scale": ("sharding.md", "scale.md", "shared-parts.md"),
}


def group_pages(group: str | None) -> list:
    """The pages of one group (`None`: every page no group names), as
    `pytest.param`s named by their path."""
    import pytest

    names = GROUPS[group] if group is not None else ()
    named = {name for group_names in GROUPS.values() for name in group_names}

    def chosen(page: Path) -> bool:
        guide = page.parent == DOCS / "guides"
        if group is None:
            return not (guide and page.name in named)
        return guide and page.name in names

    params = []
    for page in filter(chosen, pages()):
        name = str(page.relative_to(ROOT))
        count = len(part_lines(page.read_text())) + 1
        if count == 1:
            params.append(pytest.param(page, id=name))
        else:
            params += [
                pytest.param(PagePart(page, part), id=f"{name}#{part}")
                for part in range(count)
            ]
    return params


@dataclasses.dataclass(frozen=True)
class PagePart:
    """Part `part` of a page split by `PART_MARKER` lines."""

    page: Path
    part: int


def part_lines(text: str) -> list[int]:
    """The 1-based lines of a page's `PART_MARKER`s."""
    return [
        number
        for number, line in enumerate(text.splitlines(), 1)
        if line.strip() == PART_MARKER
    ]


def run_page(page: "Path | PagePart") -> None:
    """Run a page's python blocks (or a part's, after part 0's) in one
    namespace and check its quoted outputs (call with the working directory
    set to a scratch folder)."""
    part = None
    if isinstance(page, PagePart):
        page, part = page.page, page.part
    text = page.read_text()
    bounds = part_lines(text)
    namespace: dict = {"__name__": "__docs__"}
    printed = None
    for block in parse_blocks(text):
        if part is not None and sum(line < block.line for line in bounds) not in (
            0,
            part,
        ):
            continue
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
            assert normalise(block.source) in normalise(printed), (
                f"{page.name}:{block.line}: the quoted output is not what the code "
                f"printed.\n--- quoted ---\n{block.source}--- printed ---\n{printed}"
            )
