"""Functions that tests run on every rank (``labkit.parallel.launch`` imports them by name in each process)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from labkit.parallel.launch import Rank


def _write_pid(rank: Rank, pid_folder: str) -> None:
    """The rank's pid in a file named by its rank, written whole or not at all: the launcher may stop
    a rank at any moment, and a half-written file would read as no pid."""
    partial = Path(pid_folder, f"{rank.rank}.partial")
    partial.write_text(str(os.getpid()))
    os.replace(partial, Path(pid_folder, str(rank.rank)))


def raise_on_rank_one(rank: Rank, pid_folder: str) -> None:
    """Each rank writes its pid; rank 1 raises, rank 0 waits in an all-reduce that rank 1 never joins."""
    _write_pid(rank, pid_folder)
    if rank.rank == 1:
        raise ValueError("rank one cannot go on")
    dist.all_reduce(torch.zeros(1))


def hang_on_rank_one(rank: Rank, pid_folder: str) -> int:
    _write_pid(rank, pid_folder)
    if rank.rank == 1:
        time.sleep(600)
    return rank.rank


def exit_on_rank_one(rank: Rank, pid_folder: str) -> int:
    _write_pid(rank, pid_folder)
    if rank.rank == 1:
        os._exit(7)
    time.sleep(600)  # rank 0 is stopped by the caller, once it sees rank 1 gone
    return rank.rank


def sleep_forever(rank: Rank, pid_folder: str) -> None:
    _write_pid(rank, pid_folder)
    time.sleep(600)


def environment_variable(rank: Rank, name: str) -> str | None:
    """What the rank's environment holds under ``name``."""
    return os.environ.get(name)


def environment_to_file(path: str, name: str) -> None:
    """Write what this process's environment holds under ``name`` (or "-") to ``path``."""
    Path(path).write_text(os.environ.get(name, "-"))
