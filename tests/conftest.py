"""Shared fixtures (the repository root), and the order in which ``make test`` hands out the tests."""
from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK_TESTS = "tests/test_notebooks.py::"  # xdist's node ids, from the rootdir
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def root() -> Path:
    return ROOT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The notebooks first: each lab takes a minute or two, and the unit tests' files, seconds each
    but for a few, fill in around them, so that both workers end together."""
    items.sort(key=lambda item: item.get_closest_marker("notebook") is None)  # stable: files stay in order


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, but each lab's notebooks a unit of their own: run as one file, the
    thirteen labs would take one worker for a quarter of an hour while the other sat idle."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LabFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return nodeid if nodeid.startswith(NOTEBOOK_TESTS) else super()._split_scope(nodeid)

    return LabFileScheduling(config, log)
