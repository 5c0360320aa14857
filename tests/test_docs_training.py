"""The training guides' examples run (see `_docs_pages.py`)."""

from pathlib import Path

import pytest
from _docs_pages import group_pages, run_page


@pytest.mark.parametrize("page", group_pages("training"))
def test_page_code_runs(page: Path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a page writes land in a scratch folder
    run_page(page)
