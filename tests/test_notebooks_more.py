"""The second half of the notebooks (see `SECOND_FILE` in tests/test_notebooks.py):
a separate file so that `--dist loadfile` runs it on another worker."""

from pathlib import Path

import pytest
from test_notebooks import NOTEBOOKS, SECOND_FILE, run_notebook, sized

# The longest notebooks (about 75, 55 and 60 s on 2 cores) run with `-m slow`
# (`make test-all`) only: their guides (docs/guides/shared-parts.md,
# docs/guides/sweeps.md and the implicit-ensembles section of
# docs/guides/methods.md) run the same API in the default run, and the default
# run still checks that every committed notebook carries its outputs.
SLOW = {"shared_parts.ipynb", "sweeps.ipynb", "implicit_ensembles.ipynb"}


@pytest.mark.parametrize(
    ("path", "size"), sized([p for p in NOTEBOOKS if p.name in SECOND_FILE], SLOW)
)
def test_notebook_runs(path: Path, tmp_path: Path, size: str):
    run_notebook(path, tmp_path, size)
