"""Run notebooks top to bottom with other programs competing for the CPU, and show what they print.

    python benchmarks/notebooks_under_load.py solutions/01_kv_cache.ipynb solutions/05_speculative_decoding.ipynb \\
        [--busy 2] [--out /tmp/under_load]

A student's laptop runs a browser, an editor and a video call beside the notebook. This starts
``--busy`` spinning processes (``labkit.bench.busy_cpus``), executes each notebook in a fresh
kernel as JupyterLab would (nbclient; the executed copy goes to ``--out``, never over the
source), stops the spinning processes, and prints every line of the notebook's output that
states a timing, a speedup, a warning or a verdict, so that one can read whether the figures
support the text or are flagged as not trustworthy.
"""
from __future__ import annotations

import argparse
import datetime
import re
import time
from pathlib import Path

import nbformat
import torch
from nbclient import NotebookClient

from labkit import bench
from labkit.device import device_name

# the lines worth reading: timings, ratios, warnings, verdicts
INTERESTING = re.compile(r"(\d\s?(ms|us|s)\b|x as fast|speedup|WARNING|warning|trust|thread|should hold|faster|slower)")


def run(path: Path, out: Path, busy: int, timeout_s: int) -> tuple[float, list[str]]:
    """Execute the notebook at ``path`` beside ``busy`` spinning processes; seconds and its printed lines."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout_s, resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    with bench.busy_cpus(busy):
        client.execute()
    seconds = time.perf_counter() - start
    nbformat.write(nb, out / path.name)
    lines = [line for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
             for line in output.get("text", "").splitlines()]
    return seconds, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the notebook")
    parser.add_argument("--out", type=Path, default=Path("/tmp/under_load"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{datetime.date.today()}  {device_name('cpu')}  torch {torch.__version__}  {args.busy} busy processes")
    for path in args.notebooks:
        seconds, lines = run(path, args.out, args.busy, args.timeout)
        print(f"\n== {path} ran in {seconds:.0f} s beside {args.busy} busy processes (executed copy: {args.out / path.name})")
        for line in lines:
            if INTERESTING.search(line):
                print("   " + line)


if __name__ == "__main__":
    main()
