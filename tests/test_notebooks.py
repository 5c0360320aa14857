"""Every notebook in notebooks/ runs from top to bottom without a cell error.

Each notebook is executed with nbclient in a fresh Jupyter kernel started from THIS
interpreter (a kernel spec in a temporary folder, first on JUPYTER_PATH, points at
`sys.executable`, so a stray user-wide "python3" kernel cannot be picked up; a
probe cell checks it), in a scratch working directory, with a per-cell timeout.
A cell that raises fails the test with the cell's source and traceback.

The committed notebooks carry their outputs (figures included). After editing one,
refresh its outputs with:

    .venv/bin/python tests/test_notebooks.py [notebooks/name.ipynb ...]
"""

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
KERNEL_NAME = "eqx-ensemble-tests"
CELL_TIMEOUT_S = 180  # each notebook is meant to run in well under 3 minutes
_PROBE = "import sys; print(sys.executable)"


@contextlib.contextmanager
def _kernel_spec(spec_dir: Path):
    """Make `KERNEL_NAME` a kernel that runs this interpreter, found first."""
    kernel_dir = spec_dir / "kernels" / KERNEL_NAME
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "eqx_ensemble tests",
        "language": "python",
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec))
    previous = os.environ.get("JUPYTER_PATH")
    # JUPYTER_PATH is searched before the user's and the environment's folders.
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [str(spec_dir), *([previous] if previous else [])]
    )
    try:
        yield KERNEL_NAME
    finally:
        if previous is None:
            del os.environ["JUPYTER_PATH"]
        else:
            os.environ["JUPYTER_PATH"] = previous


def execute(notebook: nbformat.NotebookNode, workdir: Path, spec_dir: Path) -> None:
    """Run every cell of `notebook` in place (outputs are stored in it)."""
    with _kernel_spec(spec_dir) as kernel_name:
        # nbclient owns (starts, then shuts down and closes) the kernel and client.
        client = NotebookClient(
            notebook,
            kernel_name=kernel_name,
            timeout=CELL_TIMEOUT_S,
            allow_errors=False,
            resources={"metadata": {"path": str(workdir)}},
        )
        client.execute()


# Run from tests/test_notebooks_more.py instead: with `--dist loadfile` each test
# file runs in one worker, so the notebooks are split over two files to keep
# either from being the suite's tail.
SECOND_FILE = {
    "shared_parts.ipynb",
    "sweeps.ipynb",
    "methods.ipynb",
    "bayesian_digits.ipynb",
    "bayesian_diabetes.ipynb",
    "implicit_ensembles.ipynb",
}


# The notebooks read this variable (the first cell): "test" runs the same code
# at a tenth of its steps, so the default tier executes every cell in seconds;
# `make test-all` also runs each at its published size (`full`, marked slow).
SIZE_VARIABLE = "EQX_ENSEMBLE_EXAMPLE_SIZE"


def sized(paths: list[Path], slow: set[str] = frozenset()) -> list[Any]:
    """`(path, size)` parameters: each notebook at test size (slow if its name
    is in `slow`), and at full size (slow) where it reads `SIZE_VARIABLE`."""
    params = []
    for path in paths:
        marks = [pytest.mark.slow] if path.name in slow else []
        params.append(pytest.param(path, "test", id=path.name, marks=marks))
        if SIZE_VARIABLE in path.read_text():
            params.append(
                pytest.param(
                    path, "full", id=f"{path.name}-full", marks=pytest.mark.slow
                )
            )
    return params


@pytest.mark.parametrize(
    ("path", "size"), sized([p for p in NOTEBOOKS if p.name not in SECOND_FILE])
)
def test_notebook_runs(path: Path, tmp_path: Path, size: str):
    run_notebook(path, tmp_path, size)


def run_notebook(path: Path, tmp_path: Path, size: str = "full") -> None:
    """Execute `path` in a fresh kernel of this interpreter; fail on a cell error."""
    notebook = nbformat.read(path, as_version=4)
    assert notebook.cells, f"{path.name} has no cells"
    # A first cell that reports which Python the kernel runs.
    notebook.cells.insert(0, nbformat.v4.new_code_cell(_PROBE))
    workdir = tmp_path / "work"
    workdir.mkdir()
    previous = os.environ.get(SIZE_VARIABLE)
    os.environ[SIZE_VARIABLE] = size  # the kernel inherits the environment
    try:
        execute(notebook, workdir, tmp_path / "kernels")
    finally:
        if previous is None:
            del os.environ[SIZE_VARIABLE]
        else:
            os.environ[SIZE_VARIABLE] = previous
    probe_output = "".join(
        output.get("text", "") for output in notebook.cells[0].outputs
    ).strip()
    assert Path(probe_output) == Path(sys.executable), (
        f"the kernel ran {probe_output!r}, not this interpreter {sys.executable!r}"
    )


def test_committed_notebooks_carry_their_outputs():
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert code_cells, f"{path.name} has no code cells"
        unexecuted = [cell for cell in code_cells if cell.execution_count is None]
        assert not unexecuted, (
            f"{path.name} has {len(unexecuted)} unexecuted cell(s); refresh it with "
            "`.venv/bin/python tests/test_notebooks.py`"
        )
        errors = [
            output
            for cell in code_cells
            for output in cell.outputs
            if output.output_type == "error"
        ]
        assert not errors, f"{path.name} was saved with an error output"


def _refresh(paths: list[Path]) -> None:
    os.environ.pop(SIZE_VARIABLE, None)  # the published outputs: full size
    for path in paths:
        notebook = nbformat.read(path, as_version=4)
        with tempfile.TemporaryDirectory() as scratch:
            execute(notebook, path.parent, Path(scratch))
        # Saved for readers, who run the notebook with their own "python3" kernel.
        notebook.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3 (ipykernel)",
            "language": "python",
        }
        nbformat.write(notebook, path)
        print(f"refreshed {path.relative_to(ROOT)}")


if __name__ == "__main__":
    _refresh([Path(arg).resolve() for arg in sys.argv[1:]] or NOTEBOOKS)
