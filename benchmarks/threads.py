"""How many CPU threads a small-model step should use, quiet and on a busy machine.

    python benchmarks/threads.py [--model target] [--repeats 20] [--busy 2]

Times the steps the notebooks time (a decode step at position 64 and a 64-token prefill) at
every thread count from 1 to torch's default, taking
turns (1, 2, ..., 1, 2, ...), first on the machine as it is, then with ``--busy`` processes
spinning beside it (``labkit.bench.busy_cpus``: a browser, an editor and a video call). Prints
the median, the minimum, the 75th percentile and the spread of each, and the count
``labkit.bench.choose_threads`` would keep (the lowest 75th percentile) for each case.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime

import torch

import labkit
from labkit import bench
from labkit.device import device_name
from labkit.generate import decode_step


def steps(model: torch.nn.Module, prompt: list[int]) -> dict:
    tokens = torch.tensor([prompt])

    def prefill() -> None:
        with torch.inference_mode():
            model(tokens)
    return {"decode step at 64": decode_step(model, 64), "prefill of 64 tokens": prefill}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="target")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes for the loaded run")
    args = parser.parse_args()
    model, tokenizer = labkit.load(args.model, device="cpu")
    prompt = (tokenizer.encode("def add(a, b):\n    return a + b\n").ids * 64)[:64]
    default, counts = torch.get_num_threads(), bench.thread_counts()
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}  default threads {default}")
    for machine, context in [("as it is", contextlib.nullcontext()),
                             (f"{args.busy} busy processes", bench.busy_cpus(args.busy))]:
        with context:
            for name, step in steps(model, prompt).items():
                timings = bench.time_thread_counts(step, counts, repeats=args.repeats, device="cpu")
                best = bench.steadiest(timings)
                rows = "  ".join(f"{n} thr: median {bench.format_seconds(t.median_s)}, min "
                                 f"{bench.format_seconds(t.min_s)}, p75 {bench.format_seconds(t.quartiles_s[1])}, "
                                 f"IQR {t.spread_s / t.median_s:.0%}" for n, t in timings.items())
                print(f"{machine:>18} | {name:<20} | {rows} | keeps {best}")


if __name__ == "__main__":
    main()
