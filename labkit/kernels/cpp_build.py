"""Building labkit's C++ operators for the CPU (``paged_decode_cpu``, ``int4_matmul_cpu``): each is
one ``.cpp`` file, compiled the first time it is needed with torch's ``cpp_extension`` and cached
on disk, so that later runs load it at once. That needs a C++ compiler with OpenMP (g++ on Linux)
and ninja (a dependency of labkit); a build takes about 10 s.

Three compiler choices matter for speed. ``-O3 -ffast-math``: the loops may be vectorised, sums
reassociated (each operator's docstring says why that is safe for it). ``-fopenmp`` is given at
compile time only: the library is not linked to an OpenMP runtime of its own, so its OpenMP calls
resolve to the one torch has loaded already. Two runtimes in one process compete for the cores (in
a trial, SDPA ran four times slower). And the vector instructions: on an x86-64 CPU, the widest
that torch itself uses there (``torch.backends.cpu.get_cpu_capability()``: AVX-512 or AVX2, with
FMA). Without them the compiler may use only SSE2, and the paged decode operator took 1.3 to 1.4
times as long on an AVX-512 machine (``benchmarks/paged_decode_cpu.py``, in BENCHMARKS.md). The
build folder is named after them, so that machines of different kinds sharing a home folder each
build their own, and after the copy of labkit that builds it, so that two copies on one machine (a
student's checkout and an instructor's grading copy) do not rebuild over each other: a build
records its source's path, and a build from another path starts again. A copy's folders stay
after the copy is deleted, under a MB each (``~/.cache/torch_extensions``: delete them by hand).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

FLAGS = ["-O3", "-ffast-math", "-fopenmp"]
INTERRUPTED = "build stopped: interrupted by user"  # what ninja says when a SIGINT stops it
# by torch's CPU capability; not -march=native, which would tune for this exact CPU model
VECTOR_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
                "AVX2": ["-mavx2", "-mfma"]}


def build_directory(name: str) -> Path:
    """Where the library ``name`` is built and cached: under ``TORCH_EXTENSIONS_DIR`` if set, else
    torch's default (~/.cache/torch_extensions), one folder per torch and Python version, copy of labkit (a hash
    of its folder) and CPU capability."""
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    version = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    copy = hashlib.sha256(str(Path(__file__).resolve().parent).encode()).hexdigest()[:8]
    return Path(root) / f"{name}-{version}-{copy}-{torch.backends.cpu.get_cpu_capability().lower()}"


def missing_compiler() -> str | None:
    """None where a C++ compiler is on the PATH ($CXX, g++, c++ or clang++), else what to install."""
    if any(c and shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++")):
        return None
    fix = "xcode-select --install" if sys.platform == "darwin" else "sudo apt install g++"
    return f"no C++ compiler was found (tried g++, c++, clang++ and $CXX); install one ({fix})"


def build_operator(name: str, source: Path, operator: str, what: str, without: str, verbose: bool = False) -> str:
    """Compile ``source`` into the library ``name`` (or load its cached build), once per process,
    unless ``torch.ops.labkit.<operator>`` exists already; returns which it did: "built", "loaded"
    (a build on disk, its source unchanged) or "loaded already" (in this process). RuntimeError,
    saying why, where it cannot be built: ``what`` names the operator in it, ``without`` says what
    works without it."""
    if hasattr(torch.ops.labkit, operator):
        return "loaded already"
    from torch.utils.cpp_extension import load  # imported here: it is slow to import and rarely needed
    scripts = sysconfig.get_path("scripts")  # torch runs `ninja` by name: pip's may be beside this Python only,
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):  # a venv used without activating it
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    folder = build_directory(name)
    library = folder / f"{name}.so"
    missing = missing_compiler()
    if missing and not library.exists():  # said at once: torch's builder prints a page of warning
        raise RuntimeError(f"could not build labkit's {what} ({source.name}): {missing}; {without}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        flags = FLAGS + VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
        with _one_build_at_a_time(folder):  # a build another process made while this one waited is loaded
            before = library.stat().st_mtime_ns if library.exists() else None
            load(name, [str(source)], extra_cflags=flags, build_directory=str(folder), is_python_module=False,
                 verbose=verbose)
    except BaseException as error:
        _forget_build(name)
        if INTERRUPTED in str(error):  # a notebook's Interrupt reached ninja too: no verdict on this machine
            raise KeyboardInterrupt(f"the build of labkit's {what} was interrupted: run the cell again to build "
                                    "it") from error
        if not isinstance(error, (OSError, RuntimeError, ImportError)):
            raise
        raise RuntimeError(f"could not build labkit's {what} ({source.name}) in {folder}. It needs a C++ compiler "
                           f"with OpenMP (g++ on Linux) and a folder it may write to (set TORCH_EXTENSIONS_DIR); "
                           f"{without}. What the build said:\n{error}") from error
    return "loaded" if before is not None and library.stat().st_mtime_ns == before else "built"


def _forget_build(name: str) -> None:
    """Make torch build ``name`` again at the next ``load``: it records a build's version as the build starts, and
    would otherwise take one that failed or was interrupted for done, and look for a library that is not there."""
    from torch.utils.cpp_extension import JIT_EXTENSION_VERSIONER
    JIT_EXTENSION_VERSIONER.entries.pop(name, None)


@contextmanager
def _one_build_at_a_time(folder: Path) -> Iterator[None]:
    """Hold an flock on ``folder``'s build.lock, which the OS releases when the process ends, however
    it ends: another process building here is waited for. Torch's own lock file (``lock``) is not
    released by a build that is killed (a notebook kernel restarted mid-build), and torch would wait
    for it forever; with the flock held, one found there is such a build's, and is removed."""
    import fcntl  # POSIX only: elsewhere, the ImportError says the operator cannot be built here
    # read-only: an flock needs no more, and another user's lock file (a shared folder) opens too
    handle = os.open(folder / "build.lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        if (folder / "lock").exists():
            (folder / "lock").unlink(missing_ok=True)
            warnings.warn(f"removed {folder / 'lock'}, left by a build that did not finish", stacklevel=5)
        yield
    finally:
        os.close(handle)  # releases the flock
