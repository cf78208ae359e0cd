"""Across processes on this CPU: what communication costs, tensor parallelism's decode step, and
disaggregated prefill/decode against one engine doing both (issue 34).

    .venv/bin/python benchmarks/parallel.py [--repeats 3] [--steps 30] [--context 256] [--skip-disaggregation]

1. Communication: all-reduce and one-way send (half a ping-pong) between two gloo ranks, per call
   of bursts of 16 issued back to back (as a step issues them), the median of 20 bursts per message
   size from 64 bytes to 4 MiB, fitted to latency + bytes / bandwidth (``labkit.parallel.comm``;
   the all-reduce through the ring formula). Measured anew before each run of part 2; the first
   run's measurement is printed.
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
3. Disaggregation: ``labkit.parallel.disaggregate``'s mixed workload (short prompts with long
   outputs arriving at ``--rate`` per second, long prompts landing among them) served by colocated
   engines without chunked prefill (two engines of one thread, the requests dealt out in turn: the
   processes and cores of the pair; and one engine with both threads), by two engines with chunked
   prefill, and by a prefill rank + a decode rank (one thread each), ``--repeats`` times in turn.
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
from labkit.engine import SchedulerConfig
from labkit.parallel import comm, tensor
from labkit.parallel.disaggregate import mixed_workload, run_colocated, run_disaggregated

CONFIGS = {"1 rank, 1 thread": (1, 1), "1 rank, 2 threads": (1, 2), "2 ranks, 1 thread each": (2, 1)}


def communication(result: dict) -> None:
    print(f"\n1. Communication between two ranks ({result['backend']}), per call in bursts of {comm.BURST}, "
          "medians of 20 bursts:")
    print(f"{'bytes':>10}{'all-reduce (us)':>17}{'send (us)':>12}")
    for n, a, s in zip(result["sizes"], result["allreduce_s"], result["send_s"]):
        print(f"{n:>10,}{a * 1e6:>17.1f}{s * 1e6:>12.1f}")
    for link in (result["allreduce_link"], result["send_link"]):
        if link is not None:
            print(f"fit, {link.name}: latency {link.latency_s * 1e6:.1f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s")
    if result["send_fit_error"]:
        print(f"no fit, {result['send_fit_error']}")


def tensor_parallel(repeats: int, steps: int, context: int) -> None:
    """Each run: the links measured (the first run's printed as part 1), then the three configurations; the
    prediction from that run's link and one-rank step, against that run's two-rank step."""
    torch.set_num_threads(1)
    hardware = probe("cpu")
    model, _ = labkit.load("target", device="cpu")
    measured = [comm.measure(2, backend="gloo")]
    communication(measured[0])
    print(f"\n2. The target's decode step ({context} tokens cached, fp32), median of {steps} steps per run, "
          f"{repeats} runs in turn; this CPU with one thread: {hardware.bandwidth / 1e9:.1f} GB/s, "
          f"{hardware.peak_flops / 1e9:.0f} GFLOP/s")
    print(f"{'run':>4} {'all-reduce fit':>22}" + "".join(f"{name:>24}" for name in CONFIGS)
          + f"{'all-reduces':>13}{'predicted':>11}{'error':>7}")
    errors = []
    for run in range(repeats):
        if run:
            measured.append(comm.measure(2, backend="gloo"))
        link = measured[run]["allreduce_link"]
        steps_s = {name: tensor.decode_step_time("target", w, context, steps, t, backend="gloo")
                   for name, (w, t) in CONFIGS.items()}
        split = steps_s["2 ranks, 1 thread each"]
        parts = tensor.predicted_step(model, hardware, link, 2, steps_s["1 rank, 1 thread"]["step_s"], context)
        errors.append(parts["step_s"] / split["step_s"] - 1)
        print(f"{run:>4} {link.latency_s * 1e6:>7.0f} us, {link.bandwidth / 1e9:>5.2f} GB/s"
              + "".join(f"{r['step_s'] * 1e3:>21.2f} ms" for r in steps_s.values())
              + f"{split['comm_s'] * 1e3:>8.2f} ms{parts['step_s'] * 1e3:>8.2f} ms{errors[-1]:>+7.0%}")
    print("the last run's prediction in parts: " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.2f} ms"
                                                             for k, v in parts.items()))
    error = statistics.median(errors)
    print(f"median error of the prediction: {error:+.0%} (goal: within 25%: {'met' if abs(error) <= 0.25 else 'missed'})")


def disaggregation(repeats: int, rate: float) -> None:
    requests = mixed_workload(rate=rate, seed=0)
    whole, chunks = SchedulerConfig(max_num_batched_tokens=1024), SchedulerConfig(max_num_batched_tokens=256)
    ways = {"colocated, 2 engines x 1 thread": lambda: run_colocated("target", requests, 256, False, config=whole),
            "colocated, 1 engine x 2 threads": lambda: run_colocated("target", requests, 256, False, config=whole,
                                                                     instances=1, threads=2),
            "chunked (256), 2 engines x 1 thread": lambda: run_colocated("target", requests, 256, True, config=chunks),
            "disaggregated, 1 + 1 thread": lambda: run_disaggregated("target", requests, 256, config=whole)}
    print(f"\n3. Disaggregation: mixed_workload(rate={rate}), {len(requests)} requests "
          f"({sum(len(r.prompt) for r in requests):,} prompt tokens, {sum(r.params.max_new_tokens for r in requests):,} "
          f"output), 256 blocks of 16 per engine, max_num_batched_tokens 1024 (256 chunked); {repeats} runs in turn")
    print(f"{'way':<38}{'run':>4}{'ITL p50':>9}{'ITL p99':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'out tok/s':>11}  outputs")
    runs = {name: [] for name in ways}
    reference = None
    for run in range(repeats):
        for name, serve in ways.items():
            served = serve()
            outputs = [r.output for r in served.requests]
            reference = reference or outputs
            s = served.summary()
            runs[name].append(s)
            print(f"{name:<38}{run:>4}{s['median_itl_ms']:>9.1f}{s['p99_itl_ms']:>9.1f}{s['median_ttft_ms']:>10.1f}"
                  f"{s['p99_ttft_ms']:>10.1f}{s['output_throughput']:>11.1f}  "
                  f"{sum(a == b for a, b in zip(outputs, reference))}/{len(reference)} same")
            if name.startswith("disaggregated"):
                shipped = served.kv_bytes
    print(f"KV shipped: {sum(shipped.values()) / 2**20:.1f} MiB for {len(shipped)} requests")
    split = runs["disaggregated, 1 + 1 thread"]
    for base in ("colocated, 2 engines x 1 thread", "colocated, 1 engine x 2 threads"):
        itl = statistics.median(c["p99_itl_ms"] / d["p99_itl_ms"] for c, d in zip(runs[base], split))
        throughput = statistics.median(d["output_throughput"] / c["output_throughput"] for c, d in zip(runs[base], split))
        met = itl >= 2 and abs(throughput - 1) <= 0.1
        print(f"against {base}: p99 ITL {itl:.2f}x lower, output throughput ratio {throughput:.3f} (medians over the "
              f"runs; goal >= 2x at equal throughput within 10%: {'met' if met else 'missed'})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--rate", type=float, default=4.0, help="short requests per second in the mixed workload")
    parser.add_argument("--skip-disaggregation", action="store_true")
    args = parser.parse_args()
    print(f"{datetime.date.today()}  {device_name('cpu')}  {os.cpu_count()} cores  torch {torch.__version__}")
    tensor_parallel(args.repeats, args.steps, args.context)
    if not args.skip_disaggregation:
        disaggregation(args.repeats, args.rate)


if __name__ == "__main__":
    main()
