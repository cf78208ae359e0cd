"""Starting Python processes with ``spawn`` from anywhere: a notebook, a script with no
``if __name__ == "__main__"`` guard, a pytest worker.

``fork_server(*modules)`` is multiprocessing's fork server (spawn where there is none): its processes
fork from one that imported torch and ``modules`` once, and start in milliseconds where a fresh
interpreter takes seconds to import torch. They would start with the server's environment variables,
as they were when it started: ``process`` makes one that runs in its starter's.

A spawned process is a fresh interpreter that imports by name what it must run, and re-imports
the starter's main module first. ``check_importable`` refuses, by name, a function the new process
could not import (a notebook cell's, a nested one); ``main_not_rerun`` hides the main module while
processes start, so that a script's top level does not run again in each. ``threads_each`` shares the
cores out among processes that run at once.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from typing import Any, Callable, Iterator


def check_importable(fn: Any) -> None:
    """ValueError unless ``fn`` is a module's top-level function, which another process can import."""
    if getattr(fn, "__module__", "__main__") == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(f"{getattr(fn, '__qualname__', fn)!r} cannot be started in another process: define it "
                         "at the top of an importable module (a notebook cell's function is not)")


def cores() -> int:
    """The cores this process may run on (fewer than the machine's in a container or under taskset)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_each(processes: int) -> int:
    """Torch threads for each of ``processes`` that run at once: the cores shared out, at least 1."""
    return max(1, cores() // processes)


def fork_server(*modules: str) -> multiprocessing.context.BaseContext:
    """The fork server's context where the system has one, else spawn's. The server is one for the whole
    process, started at its first use with torch and the ``modules`` of the last call before then (what it
    lacks, a process imports when it needs it). Its processes start with the server's environment: make
    them with ``process``. With a GPU, labkit's modules are left out: importing labkit asks torch whether a GPU
    exists, which starts the CUDA driver, and a process forked from one that has started it cannot use
    CUDA ("Cannot re-initialize CUDA in forked subprocess")."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    import torch

    gpu = torch.cuda.is_available()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", *(m for m in modules if not (gpu and m.split(".")[0] == "labkit"))])
    return context


def process(context: multiprocessing.context.BaseContext, target: Callable[..., Any], args: tuple = (),
            **kwargs: Any) -> multiprocessing.process.BaseProcess:
    """``context.Process(target=target, args=args, **kwargs)``, run with this process's environment
    variables as they are now, not a fork server's of when it started."""
    return context.Process(target=_in_environment, args=(dict(os.environ), target, *args), **kwargs)


def _in_environment(environment: dict[str, str], target: Callable[..., Any], *args: Any) -> None:
    os.environ.clear()
    os.environ.update(environment)
    target(*args)


@contextlib.contextmanager
def main_not_rerun() -> Iterator[None]:
    """Start processes without spawn running the caller's script again in each: what they run is never
    from ``__main__`` (``check_importable``), so they need nothing of it. Spawn re-imports the main
    module by its file or module name; both are hidden while the processes start, as a notebook
    kernel's (which has neither) always are."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
