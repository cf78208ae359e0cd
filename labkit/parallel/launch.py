"""Starting W ranks, running one function on each, and stopping them all, whatever happens.

    result = launch(fn, world_size=2, args=(...))     # rank 0's return value

Each rank is a new Python process that joins one process group, meeting the others through a file
in a temporary folder: gloo on a CPU (its messages over 127.0.0.1), NCCL when there is a CUDA GPU
per rank. It runs ``fn(rank, *args)``, where ``rank`` says who it is (``Rank``), and sends back
what ``fn`` returned. ``fn`` must be importable (a module's function, not a notebook cell's): each
process imports it by name. A rank is never a fork of its starter (a notebook's kernel, with its
threads): on Linux and macOS it forks from multiprocessing's fork server
(``labkit.spawning.fork_server``), a process started once that has imported torch, so that a rank
starts in a fraction of a second where a fresh interpreter (``spawn``, as on Windows) takes seconds
to import it. Each rank runs with its starter's environment variables as they are at the launch
(``NCCL_DEBUG`` set in a notebook reaches the ranks), not the fork server's.

The caller waits for every rank and returns rank 0's result. If a rank raises, the others are
stopped and ``RankError`` shows the rank's traceback; a rank that dies without a word, or a run
that passes ``timeout_s``, is caught the same way. Every rank is gone when ``launch`` returns or
raises, and a rank also ends itself within a second of its starter's end (a notebook kernel that is
killed or restarted leaves none).
"""
from __future__ import annotations

import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from labkit.spawning import check_importable, fork_server, main_not_rerun, process, threads_each
from labkit.validate import check_counts


class RankError(RuntimeError):
    """A rank raised, died or hung; the message says which rank and shows its traceback."""


@dataclass(frozen=True)
class Rank:
    """Who a process is in the group: its rank, the world's size, its device and the backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str


def backend_for(world_size: int, backend: str | None = None) -> tuple[str, list[torch.device]]:
    """The backend and each rank's device: ``backend`` None chooses NCCL with one GPU per rank when there are
    enough CUDA GPUs, else gloo with every rank on the CPU. Name it to compare runs of different sizes on
    the same devices (a one-GPU machine runs one rank on its GPU, but two on the CPU)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = backend or ("nccl" if gpus >= world_size else "gloo")
    if backend == "gloo":
        return "gloo", [torch.device("cpu")] * world_size
    if backend != "nccl" or gpus < world_size:
        raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU ranks) or 'nccl' (one CUDA GPU per rank; this "
                         f"machine has {gpus} for {world_size} ranks)")
    return "nccl", [torch.device("cuda", r) for r in range(world_size)]


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout_s: float = 120.0,
           threads: int | None = None, backend: str | None = None) -> Any:
    """Run ``fn(rank, *args)`` on ``world_size`` new processes in one group; rank 0's result.
    ``threads``: torch's threads per rank (default: ``spawning.threads_each``, the cores shared out); ``backend``: see ``backend_for``."""
    check_counts(world_size=world_size)
    check_importable(fn)
    backend, devices = backend_for(world_size, backend)
    threads = threads or threads_each(world_size)
    context = fork_server("labkit.parallel.launch")
    results = context.Queue()
    store = tempfile.mkdtemp(prefix="labkit-ranks-")  # the ranks meet through a file: no port to race for
    procs = [process(context, _run_rank, (fn, Rank(r, world_size, devices[r], backend), args, f"file://{store}/store",
                                          threads, timeout_s, os.getpid(), results),
                     daemon=True, name=f"labkit-rank-{r}")
             for r in range(world_size)]
    finished = False
    try:
        with main_not_rerun():
            for p in procs:
                p.start()
        result = _collect(procs, results, time.monotonic() + timeout_s)
        finished = True
        return result
    finally:
        _stop(procs, grace_s=5.0 if finished else 0.0)
        results.close()
        shutil.rmtree(store, ignore_errors=True)


def _collect(procs: list, results, deadline: float) -> Any:
    """Every rank's report; rank 0's result. The first error, death or the deadline ends the wait."""
    outcomes: dict[int, Any] = {}
    while len(outcomes) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.1)
        except queue.Empty:
            _check_alive(procs, outcomes, deadline)
            continue
        if not ok:
            raised = f"rank {rank} of {len(procs)} raised:\n{payload}"
            died = _died_first(procs, outcomes, rank)
            raise RankError(f"{died}; then {raised}" if died else raised)
        outcomes[rank] = pickle.loads(payload)
    return outcomes[0]


def _died_first(procs: list, outcomes: dict[int, Any], raised: int, within_s: float = 0.25) -> str:
    """Which other rank has died, if one has (its exit seen within ``within_s``): a rank's death breaks
    the group, so an error another rank raises then (a closed connection, say) is taken for its
    consequence. Inferred from the order, not observed: a death the error caused would be named too."""
    deadline = time.monotonic() + within_s
    for rank, p in enumerate(procs):
        if rank != raised and rank not in outcomes:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if _died(p):
                return _death(procs, rank)
    return ""


def _died(p: Any) -> bool:
    """The process has ended with an error (0: it ended well; None: it still runs)."""
    return p.exitcode not in (0, None)


def _death(procs: list, rank: int) -> str:
    return f"rank {rank} of {len(procs)} died (exit code {procs[rank].exitcode}) before it reported"


def _check_alive(procs: list, outcomes: dict[int, Any], deadline: float) -> None:
    for rank, p in enumerate(procs):
        if rank not in outcomes and not p.is_alive() and _died(p):
            raise RankError(_death(procs, rank))
    if time.monotonic() > deadline:
        waiting = [r for r in range(len(procs)) if r not in outcomes]
        raise RankError(f"ranks {waiting} of {len(procs)} did not finish within the time limit: "
                        "a rank hangs (a collective that another rank never joined?)")


def _stop(procs: list, grace_s: float) -> None:
    """Give each rank ``grace_s`` to exit (after a failure: none), then terminate, then kill, any still running."""
    for p in procs:
        if p.pid is not None:
            p.join(timeout=grace_s)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()


def _die_with_parent(starter: int) -> None:
    """A thread that ends this process once its ``starter`` is gone (a killed or restarted kernel): its
    parent (the starter, or the fork server, which ends with the starter) is then gone and this process
    adopted, or the starter's pid no longer exists. It checks at once, then twice a second."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent and _exists(starter):
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="labkit-parent-watch").start()


def _exists(pid: int) -> bool:
    """Whether process ``pid`` exists (on Windows, where a signal 0 would interrupt it, always True)."""
    if os.name == "nt":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        pass
    return True


def _run_rank(fn: Callable[..., Any], rank: Rank, args: tuple, address: str, threads: int, timeout_s: float,
              parent: int, results) -> None:
    _die_with_parent(parent)
    torch.set_num_threads(threads)
    try:
        if rank.device.type == "cuda":
            torch.cuda.set_device(rank.device)
        dist.init_process_group(rank.backend, init_method=address, rank=rank.rank, world_size=rank.world_size,
                                timeout=timedelta(seconds=timeout_s))
        payload = pickle.dumps(fn(rank, *args))
        results.put((rank.rank, True, payload))
    except BaseException:  # noqa: BLE001  every failure goes back to the caller, as text
        results.put((rank.rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
