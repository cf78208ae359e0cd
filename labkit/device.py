"""Which device the lab runs on: a CUDA GPU, else Apple's MPS, else the CPU.

Set ``LABKIT_DEVICE`` (``cpu``, ``cuda``, ``cuda:1``, ``mps``) to override the choice.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from functools import lru_cache

import torch

_KNOWN_TYPES = ("cpu", "cuda", "mps")


def get_device() -> torch.device:
    """The device every notebook uses: ``LABKIT_DEVICE`` if set, else cuda, mps, cpu."""
    requested = os.environ.get("LABKIT_DEVICE", "").strip()
    if requested:
        return as_device(requested, "LABKIT_DEVICE")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _mps_available() -> bool:
    return hasattr(torch.backends, "mps") and torch.backends.mps.is_available()


def as_device(value: torch.device | str, what: str = "device") -> torch.device:
    """``value`` as a device this machine has, or a ValueError that names ``what`` was given
    (an argument, or the ``LABKIT_DEVICE`` variable) and what would do instead."""
    instead = "unset LABKIT_DEVICE" if what == "LABKIT_DEVICE" else "use 'cpu'"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what}={value!r} is not a device; use cpu, cuda, cuda:N or mps") from None
    if device.type not in _KNOWN_TYPES:
        raise ValueError(f"{what}={value!r}: the lab runs on cpu, cuda or mps, not {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what}={value!r} but torch {torch.__version__} sees no CUDA GPU; "
                         f"{instead} or install a CUDA build of torch")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"{what}={value!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
    if device.type == "mps" and not _mps_available():
        raise ValueError(f"{what}={value!r} but MPS is not available on this machine")
    return device


def synchronize(device: torch.device | str) -> None:
    """Wait until queued work on ``device`` has finished (a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def device_name(device: torch.device | str, threads: bool = True) -> str:
    """A readable name: ``cuda:0 (NVIDIA H100 80GB HBM3)`` or ``cpu (Intel Xeon ..., 2 threads)``, the
    threads this process's torch runs on (``threads=False``: ``cpu (Intel Xeon ...)``, for work that
    runs in other processes)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "mps":
        return f"mps ({platform.machine()} {platform.system()})"
    if not threads:
        return f"cpu ({_cpu_model()})"
    count = torch.get_num_threads()
    return f"cpu ({_cpu_model()}, {count} thread{'s' * (count != 1)})"


@lru_cache(maxsize=1)
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(name: str) -> str | None:
    """The installed version of a package, or None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


_LAB_PACKAGES = ("triton", "jupyterlab", "ipywidgets", "matplotlib", "plotly", "anywidget")


def describe() -> dict[str, str | None]:
    """What the lab runs on: the device, and the versions of torch and the lab's packages
    (None for one that is not installed, such as triton on a Mac)."""
    device = get_device()
    return {
        "device": str(device),
        "device name": device_name(device),
        "LABKIT_DEVICE": os.environ.get("LABKIT_DEVICE"),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **{name: package_version(name) for name in _LAB_PACKAGES},
    }
