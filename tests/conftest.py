"""Shared fixtures (the repository root), and the order in which ``make test`` hands out the tests."""
from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK_TESTS = "test_notebooks.py"  # its tests are xdist's units one by one
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The labs first: each takes a minute or two, and the unit tests' files, seconds each but for a few,
    fill in around them, so that both workers end together."""
    items.sort(key=lambda item: item.get_closest_marker("notebook") is None)  # stable: files stay in order


@pytest.hookimpl(optionalhook=True)  # xdist's hook: absent without it (-p no:xdist)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile``, but each lab's notebooks a unit of their own (as one file, the thirteen labs
    would take one worker for a quarter of an hour while the other sat idle), and the units handed out
    in the order collected, the labs first (xdist would hand out the files with the most tests first)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LabFileScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)  # the file
            return nodeid if Path(scope).name == NOTEBOOK_TESTS else scope

    config.option.loadscopereorder = False
    return LabFileScheduling(config, log)
