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
