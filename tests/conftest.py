"""Shared by every test. Its folder is on sys.path, so tests in tests/unit and tests/e2e import `helpers`."""

import datasets
import pytest


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """A datasets cache of the test's own, so one test's cached tables never answer another's."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
