"""Compiling the decode step with ``torch.compile``.

In eager mode every operation of a forward pass is a separate call: Python runs the module's
code, the dispatcher picks a kernel, the kernel launches. For a model as small as the lab's a
decode step is a few hundred such calls, and their overhead is a large share of the step (on a
GPU, most of it). ``torch.compile`` traces the step once into a graph (TorchDynamo), fuses the
elementwise work between the matmuls into generated kernels (TorchInductor: C++ with OpenMP on
a CPU, Triton on a GPU), and from then on runs the graph with one call.

It can only trace the whole step (``fullgraph=True``) if the step never leaves the graph: no
``.item()`` or ``.tolist()``, no Python branch on a tensor's value, no shape that depends on
data. The contiguous cache does all three when it plans a step; ``StaticKVCache`` does none.

Only the decode step is compiled. A prefill runs once per prompt, at a length that changes from
prompt to prompt: compiled, it would need dynamic shapes or a graph per length, and its compile
time would not be paid back by a single run, where a decode step runs hundreds of times at one
shape. So prefill stays eager, through the same static cache.

On a GPU, ``mode="reduce-overhead"`` also records the compiled step as a CUDA graph (see
``labkit.cuda_graphs``), removing the launches too. The cache's tensors are marked as static
addresses, so the graph may write into them in place.

Inductor keeps what it compiles in an on-disk cache (``cache_dir()``), so a second process that
compiles the same step starts in a fraction of the first one's time.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from labkit.model import Transformer
from labkit.static_cache import StaticKVCache

Step = Callable[[Tensor, Tensor], Tensor]


def _decode(model: Transformer, cache: StaticKVCache, tokens: Tensor, positions: Tensor) -> Tensor:
    """One step through the static cache: logits ``[B, T, vocab]``. A function of the module's
    own, not a closure, so that one compiled version serves every cache of the same shapes."""
    return model(tokens, plan=cache.plan(positions))


_compiled: dict[str | None, Callable] = {}


def compiler_problem(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` here, or None when it can: on a CPU,
    inductor writes C++ and needs a compiler to build it."""
    if torch.device(device).type != "cpu":
        return None
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if any(c and shutil.which(c) for c in candidates):
        return None
    fix = "xcode-select --install" if sys.platform == "darwin" else "sudo apt install g++"
    return (f"torch.compile on a CPU builds C++ and no C++ compiler was found (tried g++, c++, clang++ "
            f"and $CXX); install one ({fix}). Until then the step runs eagerly.")


def cache_dir() -> str:
    """Where inductor keeps compiled code between processes."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    return inductor_cache_dir()


def mode_for(device: torch.device | str) -> str | None:
    """The compile mode: ``reduce-overhead`` (CUDA graphs too) on CUDA, the default elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def _compiled_decode(mode: str | None) -> Callable:
    if mode not in _compiled:
        _compiled[mode] = torch.compile(_decode, fullgraph=True, dynamic=False, mode=mode)
    return _compiled[mode]


@dataclass
class CompiledStep:
    """A decode step on a static cache, compiled: call it with tokens and positions ``[B, T]``
    for the logits. ``compile_s`` is the time its first call took (tracing, code generation,
    building; from inductor's disk cache, far less)."""

    model: Transformer
    cache: StaticKVCache
    function: Callable
    compile_s: float = 0.0

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        with torch.inference_mode():
            return self.function(self.model, self.cache, tokens, positions)

    def warm_up(self, tokens: Tensor) -> float:
        """Run the step once on padding, timing the compilation it triggers; returns the seconds."""
        positions = torch.full_like(tokens, -1)  # padding: writes only the spare slot
        start = time.perf_counter()
        self(tokens, positions)
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        self.compile_s = time.perf_counter() - start
        return self.compile_s


def eager_step(model: Transformer, cache: StaticKVCache) -> Step:
    """The same step as ``compile_step``'s, not compiled: the baseline to compare it with."""
    def step(tokens: Tensor, positions: Tensor) -> Tensor:
        with torch.inference_mode():
            return _decode(model, cache, tokens, positions)
    return step


def compile_step(model: Transformer, cache: StaticKVCache, *, tokens_per_step: int = 1,
                 mode: str | None = "auto") -> CompiledStep | Step:
    """The decode step of ``model`` on ``cache`` compiled whole and warmed up for steps of
    ``tokens_per_step`` tokens per row (``mode``: "auto" for ``mode_for`` the device, else a
    ``torch.compile`` mode). Where no compiler can run, a warning says why and the eager step
    comes back instead."""
    if problem := compiler_problem(model.device):
        warnings.warn(problem, stacklevel=2)
        return eager_step(model, cache)
    mode = mode_for(model.device) if mode == "auto" else mode
    if model.device.type == "cuda":  # the cache is written in place by the recorded graph
        for tensor in cache.k + cache.v:
            torch._dynamo.mark_static_address(tensor)
    step = CompiledStep(model, cache, _compiled_decode(mode))
    step.warm_up(torch.zeros(cache.batch_size, tokens_per_step, dtype=torch.long, device=model.device))
    return step
