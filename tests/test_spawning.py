"""labkit.spawning: the fork server that the grader and the ranks start from."""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver

import pytest
import torch

from labkit.spawning import fork_server, process

needs_fork_server = pytest.mark.skipif("forkserver" not in multiprocessing.get_all_start_methods(),
                                       reason="this system has no fork server (spawn is used)")


def _preloaded() -> list[str]:
    return list(multiprocessing.forkserver._forkserver._preload_modules)


@needs_fork_server
def test_the_fork_server_preloads_torch_and_leaves_labkit_out_where_a_gpu_is(monkeypatch):
    """Importing labkit in the server would start CUDA's driver there, and its forks could not use CUDA."""
    saved = _preloaded()
    try:
        assert fork_server("IPython.core.interactiveshell", "labkit.grade").get_start_method() == "forkserver"
        assert _preloaded() == ["torch", "IPython.core.interactiveshell", "labkit.grade"] or torch.cuda.is_available()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        fork_server("IPython.core.interactiveshell", "labkit", "labkit.parallel.launch")
        assert _preloaded() == ["torch", "IPython.core.interactiveshell"]
    finally:
        multiprocessing.get_context("forkserver").set_forkserver_preload(saved)  # as it was


def test_without_a_fork_server_processes_are_spawned(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])
    assert fork_server("labkit").get_start_method() == "spawn"


def test_a_process_runs_in_the_environment_it_is_given_not_the_fork_servers(tmp_path, monkeypatch):
    """The grader and the ranks pass their environment as it is now: a fork server's is as it was when it started."""
    import parallel_ranks

    context = fork_server()
    for value in ("first", "set after the server started"):
        monkeypatch.setenv("LABKIT_SPAWN_TEST", value)
        started = process(context, parallel_ranks.environment_to_file, (str(tmp_path / "seen"), "LABKIT_SPAWN_TEST"))
        started.start()
        started.join(60)
        assert (tmp_path / "seen").read_text() == value
