"""The engine's own Python per step, with no model to run: notebook 04's Explore workload through
the simulator.

    .venv/bin/python benchmarks/engine_bookkeeping.py [--repeats 3]

``SimulatedEngine`` runs labkit's scheduler and block allocator, and prefix caching, on a simulated
clock: the cost model says how long each step would take on the GPU, and no model computes. So the
wall time of a run is the bookkeeping alone, what the engine spends between two forward passes
(admitting, reserving slots, preempting, naming full blocks for the prefix cache, recording
tokens). On a GPU a decode step of a small model takes a few milliseconds, and this is the part of
it that no kernel speeds up. The workload is the default of notebook 04's Explore widget, which
re-runs it at every move of a slider: 120 requests (lognormal prompts around 512 tokens, outputs
around 256) at 1, 4, 16 and 64 requests/s, Llama-3.1-8B on one H100, 256 sequences and 2,048
tokens a step. Prints the wall time of the four runs (the minimum of ``--repeats``), the steps they
took and the time per step.
"""
from __future__ import annotations

import argparse
import time

from labkit import presets
from labkit.device import device_name
from labkit.engine import SchedulerConfig
from labkit.simulate import CostModel, SimulatedEngine
from labkit.workload import lognormal, make_workload

RATES = (1, 4, 16, 64)


def explore_run() -> int:
    """Notebook 04's Explore at its defaults; the steps taken."""
    cost = CostModel(presets.model("Llama-3.1-8B"), presets.gpu("H100-SXM"), step_overhead_s=0.004)
    steps = 0
    for rate in RATES:
        requests = make_workload(120, lognormal(512, 0.8, 16, 4096), lognormal(256, 0.8, 16, 2048), rate=rate,
                                 vocab_size=32000, seed=0)
        engine = SimulatedEngine(cost, config=SchedulerConfig(256, 2048, True))
        engine.run(requests)
        steps += len(engine.log)
    return steps


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        steps = explore_run()
        times.append(time.perf_counter() - start)
    print(f"{device_name('cpu')}: notebook 04's Explore at its defaults, {steps:,} simulated steps at "
          f"{len(RATES)} rates: {min(times):.2f} s (minimum of {args.repeats}: "
          f"{', '.join(f'{t:.2f}' for t in times)}), {min(times) / steps * 1e6:.0f} us of bookkeeping a step")


if __name__ == "__main__":
    main()
