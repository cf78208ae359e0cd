"""What communication costs between ranks, measured: all-reduce and send/recv time against message size.

Each is timed on a range of message sizes, in bursts of calls issued back to back as a tensor-parallel
step issues its all-reduces (one after another, little work between: here a call costs several times
what one call alone after a barrier does), and fitted to the cost model of ``labkit.interconnect``:

    send (one way)         t(n) = latency + n / bandwidth            (half a ping-pong's round trip)
    ring all-reduce        t(n) = 2 (W - 1) x (latency + n / (W x bandwidth))

a straight line in n whose intercept is the latency term and whose slope is the bandwidth term.
The fit is ordinary least squares on the times: the large messages fix the bandwidth, and the
latency is what is left at n = 0, the plateau that the small messages share (weighing each size by
its own time instead would let one lucky small message set the latency). The result is a
``Link``, which the simulator takes as it takes a datasheet's NVLink or PCIe.

On this lab's CPU the "link" is two processes on one machine passing messages through gloo's
TCP loopback, copies through the kernel: a send's latency is tens of microseconds to a millisecond
or more, and an all-reduce's (several messages each way, each waking a process) hundreds of
microseconds to milliseconds, as the scheduler happens to wake each rank, at a few GB/s: not a GPU
interconnect's. The method is the same.
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from labkit.device import synchronize
from labkit.interconnect import Link
from labkit.parallel.launch import Rank, launch

DEFAULT_SIZES = tuple(64 * 4**k for k in range(9))  # 64 bytes .. 4 MiB (gloo sums a single float by a shortcut)
BURST = 16  # calls timed back to back: a tensor-parallel decode step of the target issues 16 all-reduces


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of t = intercept + slope x n by least squares; the intercept is kept at or above 0
    (a negative latency means the line is bent by noise)."""
    if len(sizes) != len(seconds) or len(sizes) < 2 or min(seconds) <= 0:
        raise ValueError(f"fit_line needs >= 2 sizes with positive times, got {len(sizes)} sizes, "
                         f"{len(seconds)} times")
    n = torch.tensor(sizes, dtype=torch.float64)
    t = torch.tensor(seconds, dtype=torch.float64)
    design = torch.stack([torch.ones_like(n), n], dim=1)
    intercept, slope = torch.linalg.lstsq(design, t[:, None]).solution.flatten().tolist()
    if intercept < 0:  # refit through the origin
        intercept, slope = 0.0, float((n * t).sum() / (n * n).sum())
    if slope <= 0:
        raise ValueError(f"the times do not grow with the message size (here {min(sizes):,.0f} to {max(sizes):,.0f} "
                         "bytes), so they give no bandwidth: a range too narrow, or a time far above its neighbours' "
                         "(another program busy meanwhile) that bends the line; rerun on a quieter machine, or over a "
                         "wider range of sizes")
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


def _per_call_seconds(fn, device: torch.device, repeats: int, burst: int = BURST) -> float:
    """Seconds per call of ``fn()`` issued ``burst`` times back to back, as a step issues its collectives, after
    a barrier that lines the ranks up (on a GPU, until the last has finished); the median over ``repeats`` bursts."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        for _ in range(burst):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - start) / burst)
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
        allreduce.append(_per_call_seconds(lambda: dist.all_reduce(buffer), rank.device, repeats))
        send.append(_per_call_seconds(lambda: _ping_pong(rank.rank, buffer), rank.device, repeats) / 2)
    return {"sizes": [max(1, s // 4) * 4 for s in sizes], "allreduce_s": allreduce, "send_s": send,
            "world_size": rank.world_size, "backend": rank.backend}


def measure(world_size: int = 2, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 20, threads: int | None = None,
            backend: str | None = None, timeout_s: float = 300.0) -> dict:
    """All-reduce and one-way send times (per call, of bursts issued back to back; the median of ``repeats``
    bursts on rank 0's clock) at each message size in bytes, over ``world_size`` ranks, with the links
    fitted to each: ``allreduce_link``, ``send_link``. ``threads`` and ``backend``: see ``launch``. Where the send
    times give no line (``fit_line``), ``send_link`` is None and ``send_fit_error`` says why: the all-reduce's link
    is the one the lab's predictions use, and a failure to fit it raises."""
    if world_size < 2 or not sizes or min(sizes) < 4:
        raise ValueError(f"world_size={world_size} must be >= 2 and every size >= 4 bytes (one fp32)")
    result = launch(_measure_rank, world_size, (list(sizes), repeats), timeout_s, threads, backend)
    result["allreduce_link"] = link_from_allreduce(result["sizes"], result["allreduce_s"], world_size)
    try:
        result["send_link"], result["send_fit_error"] = link_from_send(result["sizes"], result["send_s"]), None
    except ValueError as error:
        result["send_link"], result["send_fit_error"] = None, f"one-way send: {error}"
    return result
