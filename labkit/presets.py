"""Published specifications of common GPUs, for roofline plots and memory planning.

Figures are the vendors' datasheet values: memory in GB (10^9 bytes), peak memory bandwidth,
and the dense (no structured sparsity) tensor-core rate for bf16 or fp16 with fp32
accumulation (fp16 on the T4, which has no bf16). They are upper bounds, not measurements:
``labkit.hardware.probe`` measures the machine you are on.
"""
from __future__ import annotations

from labkit.hardware import Hardware

GB = 1e9
TB_S = 1e12
TFLOPS = 1e12


def _gpu(name: str, memory_gb: float, bandwidth_tb_s: float, tflops: float, dtype: str = "bf16") -> Hardware:
    return Hardware(name, memory_gb * GB, bandwidth_tb_s * TB_S, tflops * TFLOPS, dtype)


GPU_PRESETS: dict[str, Hardware] = {
    "A100-40GB": _gpu("A100 40GB SXM", 40, 1.555, 312),
    "A100-80GB": _gpu("A100 80GB SXM", 80, 2.039, 312),
    "H100-SXM": _gpu("H100 SXM 80GB", 80, 3.35, 989),
    "H200": _gpu("H200 SXM 141GB", 141, 4.8, 989),
    "L4": _gpu("L4 24GB", 24, 0.3, 121),
    "T4": _gpu("T4 16GB", 16, 0.32, 65, dtype="fp16"),
    "RTX-4090": _gpu("RTX 4090 24GB", 24, 1.008, 165),
}


def gpu(name: str) -> Hardware:
    """A GPU preset by its key, e.g. ``gpu("H100-SXM")``."""
    try:
        return GPU_PRESETS[name]
    except KeyError:
        raise KeyError(f"no GPU preset {name!r}; choose one of {', '.join(GPU_PRESETS)}") from None
