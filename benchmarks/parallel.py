"""Across processes on this CPU: what communication costs, tensor parallelism's decode step, and
disaggregated prefill/decode against one engine doing both (issue 34).

    .venv/bin/python benchmarks/parallel.py [--repeats 3] [--steps 30] [--context 256] [--skip-disaggregation]

1. Communication: all-reduce and one-way send (half a ping-pong) between two gloo ranks, median
   of 20 per message size from 4 bytes to 4 MiB, fitted to latency + bytes / bandwidth
   (``labkit.parallel.comm``; the all-reduce through the ring formula).
2. Tensor parallelism: the shipped ``target`` model's decode step (one sequence, ``--context``
   tokens cached, fp32, median of ``--steps``) on one rank with one thread, on one rank with two
   threads (both cores), and split over two ranks of one thread each, in turn ``--repeats``
   times (A B C A B C); the part of the two-rank step spent in its 16 all-reduces (two per layer).
   Then the simulator's prediction of the two-rank step (``tensor.predicted_step``: the cost
   model on this CPU's measured bandwidth and FLOP/s with one thread, the fitted all-reduce link,
   and the overhead that the one-rank, one-thread step shows beyond the roofline), against the
   measurement. Goal: within 25%.
   What two processes on two cores can show: the split itself (identical output, half the
   projections and KV heads per rank) and what an all-reduce costs against a small model's
   step; not a speed-up: each rank runs as many operations as the whole model (only narrower),
   so the per-operation overhead that dominates a small model's step on a CPU is not divided,
   and the all-reduces add to it.
3. Disaggregation: ``labkit.parallel.disaggregate``'s mixed workload on one engine without
   chunked prefill, on one engine with it, and on a prefill rank + a decode rank.
   Goal: p99 inter-token latency at least 2x lower disaggregated than colocated without
   chunking, at equal output throughput (within 10%); TTFT beside it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics

import torch

import labkit
from labkit.device import device_name
from labkit.hardware import probe
from labkit.parallel import comm, tensor

CONFIGS = {"1 rank, 1 thread": (1, 1), "1 rank, 2 threads": (1, 2), "2 ranks, 1 thread each": (2, 1)}


def communication() -> dict:
    result = comm.measure(2)
    print(f"\n1. Communication between two gloo ranks ({result['backend']}), medians of 20:")
    print(f"{'bytes':>10}{'all-reduce (us)':>17}{'send (us)':>12}")
    for n, a, s in zip(result["sizes"], result["allreduce_s"], result["send_s"]):
        print(f"{n:>10,}{a * 1e6:>17.1f}{s * 1e6:>12.1f}")
    for key in ("allreduce_link", "send_link"):
        link = result[key]
        print(f"fit, {link.name}: latency {link.latency_s * 1e6:.1f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s")
    return result


def tensor_parallel(link, repeats: int, steps: int, context: int) -> None:
    print(f"\n2. The target's decode step ({context} tokens cached, fp32), median of {steps} steps per run, "
          f"{repeats} runs in turn:")
    runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(repeats):
        for name, (world, threads) in CONFIGS.items():
            runs[name].append(tensor.decode_step_time("target", world, context, steps, threads))
    print(f"{'configuration':<26}{'step (ms), runs':>28}{'median':>9}{'all-reduce (ms)':>17}{'share':>7}")
    medians = {}
    for name, results in runs.items():
        steps_ms = [r["step_s"] * 1e3 for r in results]
        comm_ms = statistics.median(r["comm_s"] * 1e3 for r in results)
        medians[name] = statistics.median(steps_ms) / 1e3
        print(f"{name:<26}{' '.join(f'{t:.2f}' for t in steps_ms):>28}{medians[name] * 1e3:>9.2f}"
              f"{comm_ms:>17.2f}{comm_ms / 1e3 / medians[name]:>7.0%}")
    torch.set_num_threads(1)
    hardware = probe("cpu")
    model, _ = labkit.load("target", device="cpu")
    parts = tensor.predicted_step(model, hardware, link, 2, medians["1 rank, 1 thread"], context)
    measured = medians["2 ranks, 1 thread each"]
    error = parts["step_s"] / measured - 1
    print(f"simulator, on {hardware.name} ({hardware.bandwidth / 1e9:.1f} GB/s, {hardware.peak_flops / 1e9:.0f} "
          f"GFLOP/s) and the fitted all-reduce link:")
    print("  " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms" for k, v in parts.items()))
    print(f"  predicted two-rank step {parts['step_s'] * 1e3:.2f} ms against {measured * 1e3:.2f} ms measured: "
          f"{error:+.0%} (goal: within 25%: {'met' if abs(error) <= 0.25 else 'missed'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--skip-disaggregation", action="store_true")
    args = parser.parse_args()
    print(f"{datetime.date.today()}  {device_name('cpu')}  {os.cpu_count()} cores  torch {torch.__version__}")
    result = communication()
    tensor_parallel(result["allreduce_link"], args.repeats, args.steps, args.context)


if __name__ == "__main__":
    main()
