"""What communication costs between ranks, measured: all-reduce and send/recv time against message size.

Each is timed on a range of message sizes and fitted to the cost model of ``labkit.interconnect``:

    send (one way)         t(n) = latency + n / bandwidth            (half a ping-pong's round trip)
    ring all-reduce        t(n) = 2 (W - 1) x (latency + n / (W x bandwidth))

a straight line in n whose intercept is the latency term and whose slope is the bandwidth term.
The fit weighs each size by its own time (it minimises relative errors), so the small messages
fix the latency and the large ones the bandwidth. The result is a ``Link``, which the simulator
takes as it takes a datasheet's NVLink or PCIe.

On this lab's CPU the "link" is two processes on one machine passing messages through gloo's
TCP loopback, copies through the kernel: a latency of tens of microseconds, a bandwidth of a
few GB/s, not a GPU interconnect's. The method is the same.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from labkit.interconnect import Link
from labkit.parallel.launch import Rank, launch

DEFAULT_SIZES = tuple(4 * 4**k for k in range(11))  # 4 bytes .. 4 MiB


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of t = intercept + slope x n, minimising the squared relative errors; the
    intercept is kept at or above 0 (a negative latency means the line is bent by noise)."""
    if len(sizes) != len(seconds) or len(sizes) < 2 or min(seconds) <= 0:
        raise ValueError(f"fit_line needs >= 2 sizes with positive times, got {len(sizes)} sizes, "
                         f"{len(seconds)} times")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1) / t[:, None]
    intercept, slope = torch.linalg.lstsq(design, torch.ones_like(t)[:, None]).solution.flatten().tolist()
    if intercept < 0:  # refit through the origin
        intercept, slope = 0.0, float((n / t).sum() / (n * n / t / t).sum())
    return intercept, slope


def link_from_send(sizes: Sequence[float], seconds: Sequence[float], name: str = "measured send") -> Link:
    """The link whose one-way send time fits ``seconds`` at ``sizes`` bytes."""
    intercept, slope = fit_line(sizes, seconds)
    return Link(name, intercept, 1 / slope)


def link_from_allreduce(sizes: Sequence[float], seconds: Sequence[float], world_size: int,
                        name: str = "measured all-reduce") -> Link:
    """The link whose ring all-reduce over ``world_size`` ranks fits ``seconds`` at ``sizes`` bytes: the
    intercept is 2 (W - 1) latencies, the slope 2 (W - 1) / (W x bandwidth)."""
    if world_size < 2:
        raise ValueError(f"world_size={world_size}: an all-reduce over one rank moves nothing to fit")
    intercept, slope = fit_line(sizes, seconds)
    steps = 2 * (world_size - 1)
    return Link(name, intercept / steps, steps / (world_size * slope))


def _median_seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, the ranks lined up by a barrier before each."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _ping_pong(rank: int, buffer: torch.Tensor) -> None:
    """Rank 0 sends ``buffer`` to rank 1, which sends it back; the other ranks wait."""
    if rank == 0:
        dist.send(buffer, 1)
        dist.recv(buffer, 1)
    elif rank == 1:
        dist.recv(buffer, 0)
        dist.send(buffer, 0)


def _measure_rank(rank: Rank, sizes: Sequence[int], repeats: int) -> dict:
    allreduce, send = [], []
    for size in sizes:
        buffer = torch.zeros(max(1, size // 4), dtype=torch.float32, device=rank.device)
        allreduce.append(_median_seconds(lambda: dist.all_reduce(buffer), repeats))
        send.append(_median_seconds(lambda: _ping_pong(rank.rank, buffer), repeats) / 2)
    return {"sizes": [max(1, s // 4) * 4 for s in sizes], "allreduce_s": allreduce, "send_s": send,
            "world_size": rank.world_size, "backend": rank.backend}


def measure(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 20,
            timeout_s: float = 300.0) -> dict:
    """All-reduce and one-way send times (medians, rank 0's clock) at each message size in bytes, over
    ``world_size`` ranks, with the links fitted to each: ``allreduce_link``, ``send_link``."""
    if world_size < 2 or not sizes or min(sizes) < 4:
        raise ValueError(f"world_size={world_size} must be >= 2 and every size >= 4 bytes (one fp32)")
    result = launch(_measure_rank, world_size, (list(sizes), repeats), timeout_s)
    result["allreduce_link"] = link_from_allreduce(result["sizes"], result["allreduce_s"], world_size)
    result["send_link"] = link_from_send(result["sizes"], result["send_s"])
    return result
