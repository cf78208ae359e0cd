"""Compiling the decode step ahead of time (``torch.export`` and AOTInductor): a step with no Python in it.

A step compiled by ``torch.compile`` (``labkit.compile``) still begins in Python at every call:
TorchDynamo checks the guards its graph was compiled under, and a Python wrapper calls the
generated kernels and the library's matrix products one by one. On a CPU, for the lab's models,
those two are most of what compiling leaves besides the arithmetic (``benchmarks/compile.py
--profile`` splits a step's time). Compiling ahead of time removes both: ``torch.export``
captures the step once as a graph of the tokens and the positions, whose state (the weights,
the cache) belongs to a module, and AOTInductor compiles that graph, with a C++ wrapper in place
of the Python one, into a shared library. A step is then one call into the library.

What is given up is the guards: the library runs the shapes it was built for, and nothing checks
anything else. ``AOTStep`` checks the inputs' shapes and dtypes before each call, and each build
checks one step against the eager step.

- The library reads the model's own weights and writes the cache's own tensors: they are handed
  to it as user-managed constants (pointers, no copy), so the eager prefill and the compiled
  steps share one cache, as with ``labkit.compile``. A weight updated in place is seen; one
  replaced by a new tensor is not (build the step again).
- A build compiles and links a whole library, which takes longer than ``torch.compile``. The
  package is kept on disk (under Inductor's cache folder) with a key of everything it depends
  on: the model's modules, config and dtype, the cache's shape, the thread count, the CPU, torch's
  version and the source of the step's code. A later build with the same key loads it instead.
- CPU only. On a GPU, CUDA graphs remove the same costs and the kernel launches besides
  (``labkit.cuda_graphs``, or ``torch.compile``'s ``mode="reduce-overhead"``).
"""
from __future__ import annotations

import hashlib
import inspect
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from labkit import model as model_code, static_cache as static_cache_code
from labkit.compile import Step, _decode, cache_dir, compiler_problem, eager_step
from labkit.model import Transformer
from labkit.static_cache import StaticKVCache


class DecodeModule(nn.Module):
    """The decode step as a module whose parameters are the model's weights and whose buffers are
    the cache's tensors: what ``torch.export`` captures, the cache as state the step writes."""

    def __init__(self, model: Transformer, cache: StaticKVCache) -> None:
        super().__init__()
        self.model, self.layout = model, cache
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            self.register_buffer(f"k{i}", k, persistent=False)
            self.register_buffer(f"v{i}", v, persistent=False)
        self.register_buffer("key_slots", cache.key_slots, persistent=False)
        self.register_buffer("rows", cache.rows, persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        layers = range(len(self.layout.k))
        cache = self.layout.over([getattr(self, f"k{i}") for i in layers], [getattr(self, f"v{i}") for i in layers],
                                 self.key_slots, self.rows)
        return _decode(self.model, cache, tokens, positions)

    def state(self) -> dict[str, Tensor]:
        """Every weight and cache tensor by the name the library knows it by (tied weights under
        each of their names)."""
        return {**dict(self.named_parameters(remove_duplicate=False)),
                **dict(self.named_buffers(remove_duplicate=False))}


@dataclass
class AOTStep:
    """A decode step compiled ahead of time: call it with tokens and positions ``[B, 1]`` for the
    logits. ``build_s`` is how long making it took (export, compile and link, or loading the
    package from disk when ``from_disk``)."""

    module: DecodeModule
    runner: object  # torch._inductor's AOTICompiledModel
    path: Path
    build_s: float
    from_disk: bool

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        shape = (self.module.layout.batch_size, 1)
        for name, tensor in (("tokens", tokens), ("positions", positions)):
            if tuple(tensor.shape) != shape or tensor.dtype != torch.long:
                raise ValueError(f"this step was compiled for {name} of shape {shape}, int64; got "
                                 f"{tuple(tensor.shape)}, {tensor.dtype} (build another step for other shapes)")
        with torch.inference_mode():
            return self.runner(tokens, positions)


def package_key(model: Transformer, cache: StaticKVCache) -> str:
    """What a package depends on, hashed: a package built under another key may compute something else."""
    parts = (str(model), repr(model.config), str(model.dtype), tuple(cache.k[0].shape), len(cache.k),
             torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(), torch.__version__,
             inspect.getsource(model_code), inspect.getsource(static_cache_code))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _export_and_compile(module: DecodeModule, path: Path) -> None:
    tokens = torch.zeros(module.layout.batch_size, 1, dtype=torch.long)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own, in export
        program = torch.export.export(module, (tokens, torch.full_like(tokens, -1)), strict=False)
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial))
            os.replace(partial, path)  # whole or not at all, for a process building the same key beside this one
        finally:
            partial.unlink(missing_ok=True)


def _load(module: DecodeModule, path: Path) -> object:
    """The package at ``path``, reading and writing ``module``'s own tensors. Constants it holds
    that are not weights or cache (the rotary table) stay its own copies."""
    runner = torch._inductor.aoti_load_package(str(path))
    state = module.state()
    runner.load_constants({name: state[name] for name in runner.get_constant_fqns() if name in state},
                          check_full_update=False, user_managed=True)
    return runner


def agrees_with_eager(step: AOTStep) -> bool:
    """One step on padding (it writes only the spare slot) against the eager step on the same cache."""
    module = step.module
    tokens = torch.zeros(module.layout.batch_size, 1, dtype=torch.long)
    positions = torch.full_like(tokens, -1)
    expected = eager_step(module.model, module.layout)(tokens, positions)
    tolerance = 1e-4 if module.model.dtype == torch.float32 else 3e-2
    return torch.allclose(step(tokens, positions), expected, rtol=tolerance, atol=tolerance)


def _build(module: DecodeModule, folder: Path) -> AOTStep:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{package_key(module.model, module.layout)}.pt2"
    start = time.perf_counter()
    if path.exists():
        step = AOTStep(module, _load(module, path), path, time.perf_counter() - start, from_disk=True)
        if agrees_with_eager(step):
            return step
        path.unlink()  # a package its key did not fully describe (the model's code changed elsewhere)
    _export_and_compile(module, path)
    step = AOTStep(module, _load(module, path), path, time.perf_counter() - start, from_disk=False)
    if not agrees_with_eager(step):
        raise RuntimeError(f"the step compiled ahead of time disagrees with the eager step ({path})")
    return step


def aot_step(model: Transformer, cache: StaticKVCache, folder: str | Path | None = None) -> AOTStep | Step:
    """The one-token decode step of ``model`` on ``cache``, compiled ahead of time, its package
    kept in ``folder`` (default: ``labkit_aot`` in Inductor's cache folder). Where it cannot be
    built (no C++ compiler, or the export or the compiler fails), a warning says why and the eager
    step comes back instead. On a GPU it refuses: CUDA graphs are the tool there."""
    if model.device.type != "cpu":
        raise ValueError(f"aot_step compiles for a CPU; on {model.device} use CUDA graphs "
                         "(labkit.cuda_graphs, or labkit.compile, whose mode records them on a GPU)")
    if problem := compiler_problem(model.device):
        warnings.warn(problem, stacklevel=2)
        return eager_step(model, cache)
    from torch._dynamo.exc import TorchDynamoException  # imported late, as in labkit.compile
    folder = Path(folder) if folder is not None else Path(cache_dir()) / "labkit_aot"
    try:
        return _build(DecodeModule(model, cache), folder)
    except (TorchDynamoException, RuntimeError, OSError) as error:
        warnings.warn(f"compiling ahead of time failed, so the step runs eagerly: {type(error).__name__}: "
                      f"{str(error).strip().splitlines()[0][:300]}", stacklevel=2)
        return eager_step(model, cache)
