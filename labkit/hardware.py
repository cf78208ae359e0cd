"""How fast is this machine, and the roofline that says what bounds a kernel.

A kernel doing F floating-point operations while moving B bytes to and from memory has
arithmetic intensity I = F / B (FLOP per byte). On a machine with peak compute P (FLOP/s)
and memory bandwidth W (bytes/s) it can run at most at

    attainable(I) = min(P, I * W)

Below the ridge point I* = P / W a kernel is memory-bound (more bandwidth helps, more FLOPs
do not); above it, compute-bound. ``probe`` measures W and P for the device at hand in a
few seconds: W from a large tensor copy, P from a square matmul. Each is timed several times
and the fastest run counts: other programs only ever slow a run down, never speed it up, so the
best run is the estimate of what the machine can do (a median drops whenever the machine is busy).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.answers import answer_to
from labkit.bench import measure
from labkit.device import device_name, get_device


@dataclass(frozen=True)
class Hardware:
    """A machine on the roofline: memory size, bandwidth and peak matmul rate."""

    name: str
    memory_bytes: float
    bandwidth: float  # bytes per second
    peak_flops: float  # FLOP per second, dense, in `dtype`
    dtype: str
    measured: bool = False  # True when probed on this machine, False for a datasheet preset

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one element in ``dtype``, the format the roof was measured or rated in, read from
        the bit count in its name: "float32" -> 4, "bf16" -> 2, "fp8" -> 1."""
        bits = re.search(r"(\d+)$", self.dtype)
        if bits is None or int(bits.group(1)) % 8:
            raise ValueError(f"cannot tell the bytes per element of dtype {self.dtype!r}: "
                             f"name it with its bit count, like 'float32', 'bf16' or 'fp8'")
        return int(bits.group(1)) // 8

    @property
    def ridge_intensity(self) -> float:
        """FLOP per byte at which the machine turns from memory-bound to compute-bound."""
        return self.peak_flops / self.bandwidth

    def attainable(self, intensity: float) -> float:
        """Highest FLOP/s a kernel of this arithmetic intensity can reach here."""
        return attainable_flops(intensity, self.peak_flops, self.bandwidth)


@dataclass(frozen=True)
class IssueRate:
    """A GPU's peak instruction issue: ``sms`` multiprocessors of ``schedulers`` each issuing one
    warp instruction (32 threads) per cycle at ``clock_hz``. Instructions set a floor on a
    kernel's time, as bytes over the bandwidth do (``labkit.kernels.issue`` counts a kernel's)."""

    name: str
    sms: int
    schedulers: int
    clock_hz: float

    @property
    def warp_instructions_per_s(self) -> float:
        return self.sms * self.schedulers * self.clock_hz

    def floor_s(self, thread_instructions: float) -> float:
        """The least time that issuing ``thread_instructions`` (summed over threads, 32 to a warp) can
        take, with every scheduler issuing at every cycle."""
        return thread_instructions / 32 / self.warp_instructions_per_s


@answer_to("ex00.1")
def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of (m x k) @ (k x n): one multiply and one add per term."""
    return 2 * m * n * k


@answer_to("ex00.1")
def matmul_bytes(m: int, n: int, k: int, bytes_per_element: float, *, weight_bytes: float | None = None) -> float:
    """Bytes moved by (m x k) @ (k x n) if each operand and the result cross memory once;
    ``weight_bytes``, when given, is the bytes per element of the weights B (k x n) stored in
    another format (int4: 0.5) than the activations A and the output C."""
    weight_bytes = bytes_per_element if weight_bytes is None else weight_bytes
    return bytes_per_element * (m * k + m * n) + weight_bytes * k * n


@answer_to("ex00.1")
def matmul_intensity(m: int, n: int, k: int, bytes_per_element: float = 2, *,
                     weight_bytes: float | None = None) -> float:
    """Arithmetic intensity (FLOP per byte) of (m x k) @ (k x n); ``weight_bytes`` as in ``matmul_bytes``."""
    return matmul_flops(m, n, k) / matmul_bytes(m, n, k, bytes_per_element, weight_bytes=weight_bytes)


@answer_to("ex00.2")
def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(peak, intensity * bandwidth)."""
    if intensity < 0 or peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"need intensity >= 0 and positive peak and bandwidth, got "
                         f"intensity={intensity}, peak_flops={peak_flops}, bandwidth={bandwidth}")
    return min(peak_flops, intensity * bandwidth)


def probe_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")  # Linux describes the first core's caches there


def last_level_cache(device: torch.device | str) -> tuple[int | None, str]:
    """Bytes of ``device``'s last-level cache (a GPU's L2, a CPU's largest cache as Linux reports it)
    and which cache that is; None and why where it cannot be read."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size, "the GPU's L2 cache"
    caches = []
    for index in CPU_CACHES.glob("index*"):  # other systems may not say
        try:
            level, size = ((index / name).read_text().strip() for name in ("level", "size"))
            caches.append((int(level), int(size[:-1]) * _SIZE_UNITS[size[-1]]))
        except (OSError, ValueError, KeyError):
            continue
    if not caches:
        return None, "the last-level cache, which this system does not report"
    level, size = max(caches)
    return size, f"this CPU's L{level} cache"


def measure_bandwidth(device: torch.device, nbytes: int, repeats: int = 7) -> float:
    """Bytes per second of a large copy, in its fastest run: each copy reads ``nbytes`` and writes ``nbytes``."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=device, label="copy")
    return 2 * src.numel() * 4 / timing.min_s


def measure_matmul_rate(device: torch.device, n: int, dtype: torch.dtype, repeats: int = 7) -> float:
    """FLOP per second of an n x n by n x n matmul in ``dtype``, in its fastest run."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    timing = measure(lambda: a @ b, warmup=2, repeats=repeats, device=device, label="matmul")
    return matmul_flops(n, n, n) / timing.min_s


def probe(device: torch.device | str | None = None) -> Hardware:
    """Measure this device's memory bandwidth and matmul rate (a few seconds), each from its fastest
    run: noise only ever slows a run, so the best run is what the machine can do."""
    device = torch.device(device) if device is not None else get_device()
    on_gpu = device.type != "cpu"
    dtype = probe_dtype(device)
    bandwidth = measure_bandwidth(device, nbytes=(1 << 30) if on_gpu else (256 << 20))
    peak = measure_matmul_rate(device, n=8192 if on_gpu else 1024, dtype=dtype)
    return Hardware(name=device_name(device), memory_bytes=_memory_bytes(device), bandwidth=bandwidth,
                    peak_flops=peak, dtype=str(dtype).removeprefix("torch."), measured=True)
