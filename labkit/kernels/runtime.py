"""Where the Triton kernels run, and what they share: on a CUDA GPU they compile to native code;
without one, Triton's interpreter runs them on the CPU. The choice has to be made before triton
is imported (``triton.language``'s own functions, ``tl.max`` and ``tl.sum`` among them, are defined
then), so importing this module sets ``TRITON_INTERPRET=1`` (unless it is set already) when torch
sees no CUDA GPU, and only then imports triton: the device comes from torch, not from Triton's
driver. Without triton installed it still imports: ``MISSING`` says what is missing."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError as error:  # pragma: no cover - exercised in a subprocess by the tests
    triton = tl = None
    MISSING: str | None = (f"Triton is not installed ({error}); install it with `pip install triton` "
                           "(Linux) to run the kernels. labkit.kernels.tiled works without it.")
else:
    MISSING = None


def interpreted() -> bool:
    """Whether Triton kernels run in the interpreter (on the CPU) rather than compiled for a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def require_triton() -> None:
    """Raise ImportError, saying what is missing, when Triton is not installed."""
    if MISSING is not None:
        raise ImportError(MISSING)


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and one the kernels can run on: CUDA, or the CPU under the interpreter."""
    require_triton()
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the tensors are on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cpu" and not interpreted():
        raise ValueError("the tensors are on the CPU but Triton is compiling for a GPU: set TRITON_INTERPRET=1 "
                         "before importing triton to run the kernels in its interpreter, or move them to cuda")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"Triton kernels run on cuda (or on the CPU in the interpreter), not {device.type}")


def unit_last_stride(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The tensors, copied only where needed so that their last dimension is contiguous: the
    kernels pass every other stride but step along the head dimension by 1."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def compile_for_gpu(kernel, types: dict[str, str], constexprs: dict, capability: int, **options):
    """``kernel`` (a ``@triton.jit`` function) compiled for an NVIDIA GPU of compute ``capability``
    (90: an H100, 80: an A100), which Triton can do without one: the path the interpreter never
    takes (layouts, types, tile sizes), down to PTX and a cubin. ``types``: the Triton type of each
    argument that is not an int32 (``"*fp16"``, ``"fp32"``); every pointer and integer argument is
    taken as a multiple of 16 (aligned tensors, sizes such as 4096), as Triton would specialise a
    launch on them. ``options``: ``num_warps``, ``num_stages``. Returns Triton's compiled kernel
    (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``). Call it with ``TRITON_INTERPRET=0`` set
    before triton is imported (else ``triton.jit`` makes interpreted functions, which do not compile)."""
    require_triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    unknown = sorted(set(types) - set(kernel.arg_names)) + sorted(set(constexprs) - set(kernel.arg_names))
    if unknown:
        raise ValueError(f"{kernel.__name__} has no argument {', '.join(unknown)}; its arguments: "
                         f"{', '.join(kernel.arg_names)}")
    kinds = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
               if kinds[name] == "i32" or kinds[name].startswith("*")}
    return triton.compile(ASTSource(fn=kernel, signature=kinds, constexprs=constexprs, attrs=aligned),
                          target=GPUTarget("cuda", capability, 32), options=options)
