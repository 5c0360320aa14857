"""The docstring examples of the submodules' public names (`ee.calibration`,
`ee.nn`, `ee.metrics`, ...) run; test_docstrings.py runs the top-level names'."""

import pytest
from test_docstrings import _examples, run_example


@pytest.mark.parametrize("source", list(_examples(submodules=True)))
def test_docstring_example_runs(source, tmp_path, monkeypatch):
    run_example(source, tmp_path, monkeypatch)
