"""Paged decode attention on the CPU, in C++: what the Triton kernel of ``paged_decode`` does on a
GPU, for the engine when it runs on a CPU.

``labkit.paged`` attends by gathering each sequence's blocks into a contiguous copy first
(``gather_kv``), then calling SDPA. On a CPU that copy is a large part of a decode step. This
operator (``paged_decode_cpu.cpp``) reads each key and value row straight from the pools through
the block table, from memory once for all the query heads that share it, and runs the sequences
in parallel on torch's own threads. It is fp32 only, the CPU model's default dtype.

It is compiled the first time ``build`` is called, with torch's ``cpp_extension``: that needs a
C++ compiler with OpenMP (g++ on Linux) and ninja (a dependency of labkit), takes about 10 s, and
is cached on disk (``build_directory``), so that later runs load it at once. The engine uses
it only when asked (``Engine(..., decode_kernel=paged_decode_cpu)``): the pure-PyTorch path stays
the default, and is the reference the tests compare this with.

Three compiler choices matter for speed. ``-ffast-math`` lets the softmax's ``exp`` be vectorised;
it is safe here, since every length is at least 1 and the largest score is subtracted, so no
infinity or NaN arises. ``-fopenmp`` is given at compile time only: the library is not linked
to an OpenMP runtime of its own, so its OpenMP calls resolve to the one torch has loaded already.
Two runtimes in one process compete for the cores (in a trial, SDPA ran four times slower). And
the vector instructions: on an x86-64 CPU, the widest that torch itself uses there
(``torch.backends.cpu.get_cpu_capability()``: AVX-512 or AVX2, with FMA). Without them the
compiler may use only SSE2, and the kernel took 1.3 to 1.4 times as long on an AVX-512 machine
(``benchmarks/paged_decode_cpu.py``, in BENCHMARKS.md). The build folder is named after them,
so that machines of different kinds sharing a home folder each build their own.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from labkit.kernels.runtime import unit_last_stride
from labkit.validate import check_paged_decode

SOURCE = Path(__file__).with_suffix(".cpp")
FLAGS = ["-O3", "-ffast-math", "-fopenmp"]
# by torch's CPU capability; not -march=native, which would tune for this exact CPU model
VECTOR_FLAGS = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
                "AVX2": ["-mavx2", "-mfma"]}


def build_directory() -> Path:
    """Where the operator is built and cached: under ``TORCH_EXTENSIONS_DIR`` if set, else torch's
    default (~/.cache/torch_extensions), one folder per torch and Python version and CPU capability."""
    from torch.utils.cpp_extension import get_default_build_root
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    version = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
    return Path(root) / f"labkit_paged_decode_cpu-{version}-{torch.backends.cpu.get_cpu_capability().lower()}"


def build(verbose: bool = False) -> None:
    """Compile (or load the cached build of) the operator, once per process; RuntimeError, saying
    why, where it cannot be built."""
    if hasattr(torch.ops.labkit, "paged_decode"):
        return
    from torch.utils.cpp_extension import load  # imported here: it is slow to import and rarely needed
    scripts = sysconfig.get_path("scripts")  # torch runs `ninja` by name: pip's may be beside this Python only,
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts):  # a venv used without activating it
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    folder = build_directory()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        flags = FLAGS + VECTOR_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
        with _one_build_at_a_time(folder):
            load("labkit_paged_decode_cpu", [str(SOURCE)], extra_cflags=flags, build_directory=str(folder),
                 is_python_module=False, verbose=verbose)
    except (OSError, RuntimeError, ImportError) as error:
        raise RuntimeError(f"could not build labkit's C++ paged decode operator ({SOURCE.name}) in {folder}. It "
                           f"needs a C++ compiler with OpenMP (g++ on Linux) and a folder it may write to (set "
                           f"TORCH_EXTENSIONS_DIR); the engine needs neither without a decode_kernel. What the build "
                           f"said:\n{error}") from error


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
            warnings.warn(f"removed {folder / 'lock'}, left by a build that did not finish", stacklevel=4)
        yield
    finally:
        os.close(handle)  # releases the flock


def paged_decode_cpu(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, lengths: Tensor,
                     scale: float | None = None) -> Tensor:
    """What ``labkit.paged.paged_attention`` computes, without gathering, on the CPU in fp32:
    ``q`` ``[B, n_heads, d]`` attends to the first ``lengths[b]`` keys and values of sequence b,
    read from the pools ``[num_blocks, block_size, n_kv_heads, d]`` through ``block_tables``
    ``[B, max_blocks]``: only the entries a sequence reads, its first ceil(lengths[b] / block_size),
    must name blocks of the pools; the rest are never read. Builds the operator on first use (``build``)."""
    devices = {t.device.type for t in (q, k_pool, v_pool, block_tables, lengths)}
    if devices != {"cpu"}:
        raise ValueError(f"paged_decode_cpu runs on the CPU, got tensors on {sorted(devices)}: on a GPU use "
                         f"labkit.kernels.paged_decode")
    # the operator checks each length and each block it reads itself, in its loop over them:
    # reading the tensors here as well took about 7 us a call, once per layer of every engine step
    check_paged_decode(q, k_pool, v_pool, block_tables, lengths, dtypes=(torch.float32,), ranges=False)
    build()
    q, k_pool, v_pool = unit_last_stride(q, k_pool, v_pool)
    return torch.ops.labkit.paged_decode(q, k_pool, v_pool, block_tables, lengths,
                                         q.shape[-1] ** -0.5 if scale is None else scale)
