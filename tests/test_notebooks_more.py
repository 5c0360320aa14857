"""The second half of the notebooks (see `SECOND_FILE` in tests/test_notebooks.py):
a separate file so that `--dist loadfile` runs it on another worker."""

from pathlib import Path

import pytest
from test_notebooks import NOTEBOOKS, SECOND_FILE, run_notebook


@pytest.mark.parametrize(
    "path",
    [path for path in NOTEBOOKS if path.name in SECOND_FILE],
    ids=lambda path: path.name,
)
def test_notebook_runs(path: Path, tmp_path: Path):
    run_notebook(path, tmp_path)
