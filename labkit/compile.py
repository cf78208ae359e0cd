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

import time
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from labkit.cuda_graphs import GraphedStep, require_cuda
from labkit.kernels.cpp_build import missing_compiler
from labkit.model import Transformer
from labkit.static_cache import StaticKVCache, decode_static, static_length

Step = Callable[[Tensor, Tensor], Tensor]


def fresh_decode() -> Callable:
    """``decode_static`` on a code object of its own: TorchDynamo keeps its graphs, and its
    recompile limit, per code object, so each compiled function gets one."""
    return types.FunctionType(decode_static.__code__.replace(), decode_static.__globals__, decode_static.__name__)


# One compiled function per set of shapes, each on a code object of its own: TorchDynamo keeps
# its graphs and its recompile limit per code object, and with fullgraph=True a function that
# reaches the limit raises instead of running eagerly. So shapes never compete for one limit.
_compiled: dict[tuple, Callable] = {}


def _compiled_decode(model: Transformer, cache: StaticKVCache, mode: str | None) -> Callable:
    # the config's repr, not the config: a Llama-3 config holds a dict (rope_scaling), which does not hash
    key = (mode, repr(model.config), model.dtype, str(model.device), cache.batch_size, cache.max_len)
    if key not in _compiled:
        _compiled[key] = torch.compile(fresh_decode(), fullgraph=True, dynamic=False, mode=mode)
    return _compiled[key]


def failure_line(error: BaseException) -> str:
    """An error's type and the first line of its message (a compiler's can run to pages), for a warning."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:300]}"


def compiler_problem(device: torch.device | str) -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` here, or None when it can: on a CPU,
    inductor writes C++ and needs a compiler to build it."""
    missing = missing_compiler() if torch.device(device).type == "cpu" else None
    return f"torch.compile on a CPU builds C++ and {missing}. Until then the step runs eagerly." if missing else None


def cache_dir() -> str:
    """Where inductor keeps compiled code between processes."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir
    return inductor_cache_dir()


def mode_for(device: torch.device | str) -> str | None:
    """The compile mode: ``reduce-overhead`` (CUDA graphs too) on CUDA, the default elsewhere."""
    return "reduce-overhead" if torch.device(device).type == "cuda" else None


def inductor_start_up(device: torch.device) -> float:
    """Seconds to compile a one-line function on ``device``: Inductor's one-time start-up in a process
    (importing its modules, probing the C++ compiler or Triton), which would otherwise land in
    whichever step compiles first. Needs a compiler (``compiler_problem``)."""
    start = time.perf_counter()
    torch.compile(lambda t: (2 * t).relu().sum(), fullgraph=True)(torch.ones(64, device=device))
    return time.perf_counter() - start


@dataclass
class CompiledStep:
    """A decode step on a static cache, compiled: call it with tokens and positions ``[B, T]``
    for the logits. ``compile_s`` is the time its first call took (tracing, code generation,
    building; from inductor's disk cache, far less), and ``built_from`` says which it was: "code
    generated" (Inductor built it, its disk cache missed or bypassed), "Inductor's disk cache" (a run
    before built it), or "this process" (no graph captured: compiled already, for another cache of the
    same shapes)."""

    model: Transformer
    cache: StaticKVCache
    function: Callable
    compile_s: float = 0.0
    built_from: str = ""

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        with torch.inference_mode():
            return self.function(self.model, self.cache, tokens, positions)

    def warm_up(self, tokens: Tensor) -> float:
        """Run the step once on padding, timing the compilation it triggers; returns the seconds."""
        from torch._dynamo.utils import counters  # TorchDynamo counts the graphs it captures, Inductor its
        positions = torch.full_like(tokens, -1)  # disk cache's hits and misses; padding writes only the spare slot
        graphs, before = counters["stats"]["unique_graphs"], dict(counters["inductor"])
        start = time.perf_counter()
        self(tokens, positions)
        if tokens.is_cuda:
            torch.cuda.synchronize(tokens.device)
        self.compile_s = time.perf_counter() - start
        grew = {key for key, n in counters["inductor"].items() if n > before.get(key, 0)}
        self.built_from = ("this process" if counters["stats"]["unique_graphs"] == graphs else
                           "Inductor's disk cache" if grew & {"fxgraph_cache_hit"} and not grew & {"fxgraph_cache_miss"}
                           else "code generated")
        return self.compile_s


def eager_step(model: Transformer, cache: StaticKVCache) -> Step:
    """The same step as ``compile_step``'s, not compiled: the baseline to compare it with."""
    def step(tokens: Tensor, positions: Tensor) -> Tensor:
        with torch.inference_mode():
            return decode_static(model, cache, tokens, positions)
    return step


def compile_step(model: Transformer, cache: StaticKVCache) -> CompiledStep | Step:
    """The one-token decode step of ``model`` on ``cache`` compiled whole (``mode_for`` its device)
    and warmed up. Where it cannot compile (no C++ compiler on a CPU, or the compiler fails), a
    warning says why and the eager step comes back instead."""
    model.check_cache(cache)
    if problem := compiler_problem(model.device):
        warnings.warn(problem, stacklevel=2)
        return eager_step(model, cache)
    tokens = torch.zeros(cache.batch_size, 1, dtype=torch.long, device=model.device)
    model.rotary(tokens)  # moves the rotary table to the device now, not inside the first compiled call
    if model.device.type == "cuda":  # the cache is written in place by the recorded graph
        for tensor in cache.k + cache.v:
            torch._dynamo.mark_static_address(tensor)
    from torch._dynamo.exc import TorchDynamoException  # here: importing TorchDynamo imports triton, which
    # must come after labkit.kernels has chosen Triton's interpreter on a machine without a GPU
    step = CompiledStep(model, cache, _compiled_decode(model, cache, mode_for(model.device)))
    try:
        step.warm_up(tokens)
    except (TorchDynamoException, RuntimeError, OSError) as error:
        warnings.warn(f"torch.compile failed, so the step runs eagerly: {failure_line(error)}", stacklevel=2)
        return eager_step(model, cache)
    return step


def graphed_compiled_step(model: Transformer, cache: StaticKVCache) -> GraphedStep:
    """The decode step compiled, then recorded by hand as one CUDA graph (a GPU only): compiled in
    the default mode, which records no graph of its own, so that the recording holds Inductor's
    fused kernels, and a replay runs no Python at all, where ``mode="reduce-overhead"`` still runs
    TorchDynamo's guard check and its graph trees' bookkeeping at every call. Compile, then
    record: what vLLM does. The recording's warm-up calls compile it (errors from the compiler
    propagate)."""
    require_cuda(model.device)
    model.rotary(torch.zeros(cache.batch_size, 1, dtype=torch.long, device=model.device))  # the table, on the device
    return GraphedStep(model, cache, decode=_compiled_decode(model, cache, mode=None))


def one_row_cache(model: Transformer, tokens: int) -> StaticKVCache:
    """A static cache of one row, on the model's device and in its dtype, for a sequence of
    ``tokens`` tokens (its length rounded up by ``static_length``)."""
    return StaticKVCache(model.config, 1, static_length(model.config, tokens), model.dtype, model.device)


def static_decoder(model: Transformer, tokens: int, use_cuda_graphs: bool = False, ahead_of_time: bool = False
                   ) -> tuple[StaticKVCache, Step]:
    """A static cache of one row for a sequence of ``tokens`` tokens (its length rounded up by
    ``static_length``) and its decode step, compiled, or with ``use_cuda_graphs`` recorded as a
    CUDA graph (``labkit.cuda_graphs``), or with ``ahead_of_time`` compiled ahead of time
    (``labkit.aot``, a CPU only; on one row, its matrix products Inductor's where they are faster
    beyond noise, else the library's). Each call makes a new cache, so on a GPU a new recording: a few
    milliseconds, paid once per generation; ahead of time, a build that keeps its cache for the
    life of the process, so that one is made once and reused."""
    if use_cuda_graphs and ahead_of_time:
        raise ValueError("a decode step is recorded as a CUDA graph or compiled ahead of time, not both")
    cache = one_row_cache(model, tokens)
    if ahead_of_time:
        from labkit.aot import aot_step  # here: labkit.aot builds on this module
        return cache, aot_step(model, cache)
    return cache, GraphedStep(model, cache) if use_cuda_graphs else compile_step(model, cache)
