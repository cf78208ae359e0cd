"""Compiling the decode step ahead of time (``torch.export`` and AOTInductor): a step with no Python in it.

A step compiled by ``torch.compile`` (``labkit.compile``) still begins in Python at every call:
TorchDynamo checks the guards its graph was compiled under, and a Python wrapper calls the
generated kernels and the library's matrix products one by one. On a CPU, for the lab's models,
those two are a large share of what compiling leaves besides the arithmetic
(``benchmarks/compile_wrappers.py`` takes the saving apart). Compiling ahead of time removes both:
``torch.export`` captures the step once as a graph of the tokens and the positions, whose state
(the weights, the cache) belongs to a module, and AOTInductor compiles that graph, with a C++
wrapper in place of the Python one, into a shared library. A step is then one call into the library.

What is given up is the guards: the library runs the shapes it was built for, and nothing checks
anything else. So ``AOTStep`` checks what it can cheaply before each call (the inputs' shapes and
dtypes; that no weight or cache tensor has been given new memory), and each build checks two real
steps, rotary positions and attention included, against the eager step.

- The library reads the model's own weights (with the library's products; see below) and writes
  the cache's own tensors: each is handed to it as a user-managed constant (a pointer, no copy),
  and the package holds none of them. So the eager prefill and the compiled steps share one cache,
  as with ``labkit.compile``, and a weight updated in place is seen. A weight given new memory
  (``model.to``, ``p.data = ...``) makes the step refuse to run; one replaced by a new tensor
  object (``load_state_dict(assign=True)``) is not seen: build the step again. torch's runtime
  keeps the tensors it was handed alive for the rest of the process, so build a step once and
  reuse it, as an engine does (which is why ``generate.stream`` does not offer this step: it
  would build one per generation). While a step is being exported, the model's weights are
  swapped for stand-ins: do not use the model from another thread then.
- A build compiles and links a whole library, which takes longer than ``torch.compile``. The
  package is kept on disk (under Inductor's cache folder) with a key of what it depends on: the
  model's modules and config, the kind of products, the name, shape, stride and dtype of every
  weight and cache tensor, the thread count, the CPU's model and instruction set, torch's version
  and the source of the modules the step's code comes from. A later build with the same key loads
  it instead, and builds it again if it cannot be loaded or disagrees with eager. The folder keeps
  the ``KEEP`` packages used last.
- The matrix products, two ways (``products``). ``"library"``: as ``torch.compile`` leaves them,
  calls into the BLAS library on the model's own weights. ``"generated"`` (a step of one row
  only): each one-row product rewritten into a loop Inductor generates (``labkit.row_products``),
  reading copies of the projection weights laid out by rows, which the step holds: a second copy
  of those weights in memory. Such a step cannot see a projection weight updated in place, so it
  refuses to run once one has been (through the weight itself: a write through ``p.data`` goes
  unseen) or given new memory. Which is faster depends on the CPU, so
  the default, ``"faster"``, builds a one-row step both ways, times them, and keeps the generated
  one only if it is faster beyond noise (``AOTStep.timings``; the other's library stays loaded,
  holding what it was handed); a step of several rows keeps the library's products.
- CPU only. On a GPU, CUDA graphs remove the same costs and the kernel launches besides
  (``labkit.cuda_graphs``, or ``torch.compile``'s ``mode="reduce-overhead"``).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from labkit import compile as compile_code, model as model_code, quant as quant_code
from labkit import row_products as row_products_code, static_cache as static_cache_code, validate as validate_code
from labkit.bench import alternate, not_faster
from labkit.compile import Step, cache_dir, compiler_problem, eager_step, failure_line
from labkit.device import device_name
from labkit.kernels import int4_linear as int4_code
from labkit.model import Transformer
from labkit.row_products import OneRowProducts, row_major_copies
from labkit.static_cache import StaticKVCache

# the modules a step's graph comes from, this one included (the export's arguments)
SOURCES = (model_code, static_cache_code, compile_code, quant_code, int4_code, validate_code, row_products_code,
           sys.modules[__name__])
PRODUCTS = ("library", "generated")  # how a step's matrix products are made (see the docstring)
TIMED_STEPS = 20  # steps of each kind a "faster" build times, alternately, to choose
KEEP = 32  # packages kept in a folder, the ones used last (a one-row step has two: one per kind of products)
CHECKED_POSITIONS = 2  # steps the build's check runs: position 0, then 1 (rotation, and attention over two slots)
_LOADING = threading.Lock()  # held while TMPDIR points at a load's own folder: one load at a time


def _check_rows(products: str, cache: StaticKVCache) -> None:
    if products == "generated" and cache.batch_size != 1:
        raise ValueError(f"generated products rewrite products of one row; this cache has {cache.batch_size} rows")


def _version(tensor: Tensor) -> int:
    """How many times ``tensor`` has been written in place (through itself: not through ``.data``);
    -1 for a tensor made in inference mode, which keeps no count."""
    return -1 if tensor.is_inference() else tensor._version


class DecodeModule(nn.Module):
    """The decode step as a module whose parameters are the model's weights and whose buffers are
    the cache's tensors and the rotary table (and, for generated products, the weights' copies laid
    out by rows, which stand in for the model's in its projections): what ``torch.export`` captures,
    the cache as state the step writes."""

    def __init__(self, model: Transformer, cache: StaticKVCache, products: str = "library") -> None:
        super().__init__()
        if products not in PRODUCTS:
            raise ValueError(f"products={products!r}: choose one of {PRODUCTS}")
        _check_rows(products, cache)
        self.model, self.cache, self.products = model, cache, products
        copies = row_major_copies(model) if products == "generated" else {}
        self.by_rows = {name: f"weight_rows{i}" for i, name in enumerate(copies)}  # a weight's name -> its copy's
        # what the copies were made from: each weight, where its memory was and its version then
        self.copied = [(w, w.data_ptr(), _version(w)) for w in map(model.get_parameter, copies)]
        for name, copy in copies.items():
            self.register_buffer(self.by_rows[name], copy, persistent=False)
        for i, (k, v) in enumerate(zip(cache.k, cache.v)):
            self.register_buffer(f"k{i}", k, persistent=False)
            self.register_buffer(f"v{i}", v, persistent=False)
        self.register_buffer("key_slots", cache.key_slots, persistent=False)
        self.register_buffer("rows", cache.rows, persistent=False)
        self.register_buffer("rope", model.rope, persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        layers = range(len(self.cache.k))
        cache = self.cache.with_tensors([getattr(self, f"k{i}") for i in layers],
                                        [getattr(self, f"v{i}") for i in layers], self.key_slots, self.rows)
        table, self.model.rope = self.model.rope, self.rope  # traced as this module's buffer, not baked in
        weights = {name: getattr(self, copy) for name, copy in self.by_rows.items()}
        # the call decode_static makes, the copies standing in for the model's weights (a tied one under both names)
        try:
            return torch.func.functional_call(self.model, weights, (tokens,), {"plan": cache.plan(positions)},
                                              tie_weights=True, strict=False)
        finally:
            self.model.rope = table

    def state(self) -> dict[str, Tensor]:
        """Every weight and cache tensor by the name the library knows it by (tied weights under
        each of their names)."""
        return {**dict(self.named_parameters(remove_duplicate=False)),
                **dict(self.named_buffers(remove_duplicate=False))}


@dataclass
class AOTStep:
    """A decode step compiled ahead of time: call it with tokens and positions ``[B, 1]`` for the
    logits. ``build_s`` is how long making it took (export, compile and link, or loading the
    package from disk when ``from_disk``; the check against eager included)."""

    module: DecodeModule
    runner: object  # torch._inductor's AOTICompiledModel
    path: Path
    from_disk: bool
    handed: list[tuple[Tensor, int]]  # what the library was given, and where its memory was
    build_s: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)  # a "faster" build's median seconds per step, by products

    @property
    def products(self) -> str:
        """How this step's matrix products are made: ``"library"`` or ``"generated"``."""
        return self.module.products

    def __call__(self, tokens: Tensor, positions: Tensor) -> Tensor:
        shape = (self.module.cache.batch_size, 1)
        for name, tensor in (("tokens", tokens), ("positions", positions)):
            if tuple(tensor.shape) != shape or tensor.dtype != torch.long or tensor.device.type != "cpu":
                raise ValueError(f"this step was compiled for {name} of shape {shape}, int64, on the CPU; got "
                                 f"{tuple(tensor.shape)}, {tensor.dtype}, on {tensor.device} "
                                 "(build another step for other shapes)")
        if any(tensor.data_ptr() != address for tensor, address in self.handed):
            raise RuntimeError("a weight or cache tensor of this step has new memory since it was built "
                               "(model.to, or p.data = ...): build the step again")
        if any(t.data_ptr() != address or _version(t) != version for t, address, version in self.module.copied):
            raise RuntimeError("a weight this step holds a copy of (its products are Inductor's, on copies laid out "
                               "by rows) was updated in place or given new memory since it was built: build the "
                               "step again")
        with torch.inference_mode():
            return self.runner(tokens.contiguous(), positions.contiguous())


def package_key(module: DecodeModule) -> str:
    """What a package depends on, hashed: a package built under another key may compute something else."""
    model = module.model
    layout = [(name, tuple(t.shape), t.stride(), str(t.dtype)) for name, t in module.state().items()]
    parts = (str(model), repr(model.config), module.products, layout, device_name("cpu"),
             torch.backends.cpu.get_cpu_capability(),
             torch.__version__, [inspect.getsource(code) for code in SOURCES])  # device_name: the CPU and threads
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _export_and_compile(module: DecodeModule, path: Path) -> None:
    tokens = torch.zeros(module.cache.batch_size, 1, dtype=torch.long)
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)  # torch's own, in export
        program = torch.export.export(module, (tokens, torch.full_like(tokens, -1)), strict=False)
        configs = {"aot_inductor.package_constants_in_so": False}
        if module.products == "generated":
            configs["post_grad_custom_post_pass"] = OneRowProducts()
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs=configs)


def _load(module: DecodeModule, path: Path, from_disk: bool) -> AOTStep:
    """The package at ``path``, reading and writing ``module``'s own tensors; every constant the
    library needs must be one of them."""
    with _unpacked_in_a_folder_of_ours():
        runner = torch._inductor.aoti_load_package(str(path))
    state = module.state()
    missing = [name for name in runner.get_constant_fqns() if name not in state]
    if missing:
        raise RuntimeError(f"the package at {path} needs tensors this model does not have: {missing[:5]}")
    handed = {name: state[name] for name in runner.get_constant_fqns()}
    runner.load_constants(handed, check_full_update=True, user_managed=True)
    return AOTStep(module, runner, path, from_disk, [(t, t.data_ptr()) for t in handed.values()])


@contextlib.contextmanager
def _unpacked_in_a_folder_of_ours():
    """torch's loader unpacks a package into a new folder under ``TMPDIR`` (``aotinductor_*``) and
    removes it only when its runner is destroyed, which a process killed while holding one never
    does: point ``TMPDIR`` at a folder of ours while it loads, and remove that once the library is
    loaded (on a CPU, the only device this module compiles for, a loaded library needs its files
    no more). ``TMPDIR`` is the whole process's: loads take turns, and a subprocess started by
    another thread meanwhile would inherit the folder."""
    with _LOADING:
        folder = tempfile.mkdtemp(prefix="labkit_aot_")  # before TMPDIR changes: Python's own stays where it was
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = folder
        try:
            yield
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before
            shutil.rmtree(folder, ignore_errors=True)


def agrees_with_eager(step: AOTStep) -> bool:
    """Steps of every row at positions 0 and 1 (rotation, and attention over keys and values just
    written) against the eager step on a fresh cache: the logits, and the slots written in the
    cache's own tensors. Those slots are put back as they were."""
    module, cache = step.module, step.module.cache
    fresh = StaticKVCache(module.model.config, cache.batch_size, cache.max_len, cache.k[0].dtype, "cpu")
    eager = eager_step(module.model, fresh)
    tensors = cache.k + cache.v
    kept = [t[:, :, :CHECKED_POSITIONS].clone() for t in tensors]
    tokens = torch.arange(1, cache.batch_size + 1)[:, None] % module.model.config.vocab_size
    tolerance = 1e-4 if module.model.dtype == torch.float32 else 3e-2
    close = lambda a, b: torch.allclose(a, b, rtol=tolerance, atol=tolerance, equal_nan=True)
    try:
        agree = True
        for position in range(CHECKED_POSITIONS):
            positions = torch.full_like(tokens, position)
            agree &= close(step(tokens, positions), eager(tokens, positions))
        written = [t[:, :, :CHECKED_POSITIONS] for t in tensors]
        return agree and all(close(a, b[:, :, :CHECKED_POSITIONS]) for a, b in zip(written, fresh.k + fresh.v))
    finally:
        for tensor, before in zip(tensors, kept):
            tensor[:, :, :CHECKED_POSITIONS] = before


def _from_disk(module: DecodeModule, path: Path) -> AOTStep | None:
    """The package at ``path`` if there is one that loads and agrees with eager; one that does not
    (corrupt, or from code its key did not see) is removed."""
    if not path.exists():
        return None
    start = time.perf_counter()
    try:
        step = _load(module, path, from_disk=True)
        if agrees_with_eager(step):
            step.build_s = time.perf_counter() - start
            os.utime(path)  # used now: kept by _prune
            return step
    except Exception:  # whatever stops a package from loading or agreeing, it is not used again
        pass
    path.unlink(missing_ok=True)
    return None


def _prune(folder: Path) -> None:
    """Remove all but the ``KEEP`` packages used last (a key per model, batch size and length
    adds up); a package in use stays readable until it is closed."""
    packages = [p for p in folder.glob("*.pt2") if not p.name.endswith(".partial.pt2")]
    for old in sorted(packages, key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
        old.unlink(missing_ok=True)


def _build(module: DecodeModule, folder: Path) -> AOTStep:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{package_key(module)}.pt2"
    if step := _from_disk(module, path):
        return step
    start = time.perf_counter()
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        _export_and_compile(module, partial)
        step = _load(module, partial, from_disk=False)
        if not agrees_with_eager(step):
            raise RuntimeError("the step compiled ahead of time disagrees with the eager step")
        os.replace(partial, path)  # whole, and checked, or not at all: a process may build the same key beside this one
    finally:
        partial.unlink(missing_ok=True)
    step.path, step.build_s = path, time.perf_counter() - start
    _prune(folder)
    return step


def _faster(library: AOTStep, generated: AOTStep) -> AOTStep:
    """The generated step if it ran faster beyond noise, else the library's: ``TIMED_STEPS`` of
    each timed alternately on padding (which writes only the cache's spare slot); both medians go
    in the ``timings`` of the one kept."""
    tokens = torch.zeros(1, 1, dtype=torch.long)
    positions = torch.full_like(tokens, -1)
    timed = alternate({step.products: functools.partial(step, tokens, positions) for step in (library, generated)},
                      warmup=3, repeats=TIMED_STEPS, device="cpu")
    best = library if not_faster(timed["generated"], timed["library"]) else generated
    best.timings = {products: timing.median_s for products, timing in timed.items()}
    return best


def _build_each(model: Transformer, cache: StaticKVCache, folder: Path, kinds: tuple[str, ...]) -> list[AOTStep]:
    """A step for each kind of products that builds; a warning for each that does not, which says
    what runs instead (the eager step when none builds)."""
    steps, failures = [], []
    for kind in kinds:
        try:
            steps.append(_build(DecodeModule(model, cache, kind), folder))
        except Exception as error:  # export and Inductor raise many kinds; each is said, and the other kind kept
            failures.append(f"{failure_line(error)}" + f" ({kind} products)" * (len(kinds) > 1))
    if failures and not steps:
        warnings.warn(f"compiling ahead of time failed, so the step runs eagerly: {'; '.join(failures)}", stacklevel=3)
    elif failures:
        warnings.warn(f"compiling ahead of time failed with one kind of products, so the step keeps the "
                      f"{steps[0].products} products: {failures[0]}", stacklevel=3)
    return steps


def aot_step(model: Transformer, cache: StaticKVCache, folder: str | Path | None = None,
             products: str = "faster") -> AOTStep | Step:
    """The one-token decode step of ``model`` on ``cache``, compiled ahead of time, its package
    kept in ``folder`` (default: ``labkit_aot`` in Inductor's cache folder), its matrix products
    made by the ``"library"``, ``"generated"`` by Inductor (a cache of one row only), or, by
    default, the ``"faster"`` of the two: on a cache of one row both are built and timed, and the
    one kept has both timings and a ``build_s`` that counts both builds and the timing (where one
    kind fails to build, the other is kept, untimed, with a warning). Where no step can be built
    (no C++ compiler, or the export, the compiler or the check fails), a warning says why and the
    eager step comes back instead. On a GPU it refuses: CUDA graphs are the tool there."""
    if model.device.type != "cpu":
        raise ValueError(f"aot_step compiles for a CPU; on {model.device} use CUDA graphs "
                         "(labkit.cuda_graphs, or labkit.compile, whose mode records them on a GPU)")
    if products not in (*PRODUCTS, "faster"):
        raise ValueError(f"products={products!r}: choose one of {(*PRODUCTS, 'faster')}")
    _check_rows(products, cache)
    model.check_cache(cache)
    if problem := compiler_problem(model.device):
        warnings.warn(problem, stacklevel=2)
        return eager_step(model, cache)
    folder = Path(folder) if folder is not None else Path(cache_dir()) / "labkit_aot"
    start = time.perf_counter()
    kinds = (products,) if products != "faster" else PRODUCTS if cache.batch_size == 1 else ("library",)
    steps = _build_each(model, cache, folder, kinds)
    if len(steps) < 2:
        return steps[0] if steps else eager_step(model, cache)
    best = _faster(*steps)
    best.build_s, best.from_disk = time.perf_counter() - start, all(step.from_disk for step in steps)
    return best
