"""Run notebooks top to bottom with other programs competing for the CPU, and show what they print.

    python benchmarks/notebooks_under_load.py solutions/01_kv_cache.ipynb solutions/05_speculative_decoding.ipynb \\
        [--busy 2] [--out /tmp/under_load] [--default-threads]

A student's laptop runs a browser, an editor and a video call beside the notebook. This starts
``--busy`` spinning processes (``labkit.bench.busy_cpus``), executes each notebook in a fresh
kernel as JupyterLab would (``labkit.execute``; the executed copy goes to ``--out``, never over the
source), stops the spinning processes, and prints every line of the notebook's output that
states a timing, a speedup, a warning or a verdict, so that one can read whether the figures
support the text or are flagged as not trustworthy. ``--keep-going`` runs every cell even after one
raises, and lists the cells that did (with ``--busy 0``: how a lent GPU machine ran the notebooks'
GPU branches once, each notebook's seconds and errors in one pass). ``--default-threads`` is the counter-experiment:
the notebooks keep torch's default thread count instead of choosing one by measurement (what
they did before issue 31), so that one sees what the physics checks say then.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import time
from pathlib import Path

import nbformat
import torch
from labkit import bench, execute
from labkit.device import device_name

# the lines worth reading: timings, ratios, warnings, verdicts
INTERESTING = re.compile(r"(\d\s?(ms|us|s)\b|x as fast|speedup|WARNING|warning|trust|thread|should hold|faster|slower|"
                         r"ERROR)")


# the counter-experiment's first cell: choose_threads keeps torch's default and says so
KEEP_DEFAULT_THREADS = """import torch
from labkit import bench
def keep_default(step, **kwargs):
    print(f"thread choice switched off: torch's default, {torch.get_num_threads()} threads")
    return torch.get_num_threads()
bench.choose_threads = keep_default"""


def run(path: Path, out: Path, busy: int, timeout_s: int, default_threads: bool, keep_going: bool = False
        ) -> tuple[float, list[str]]:
    """Execute the notebook at ``path`` beside ``busy`` spinning processes; seconds and its printed lines
    (with ``keep_going``, every cell runs, and each error is a line of its own)."""
    nb = nbformat.read(path, as_version=4)
    if default_threads:
        nb.cells.insert(0, nbformat.v4.new_code_cell(KEEP_DEFAULT_THREADS))
    start, stopped = time.perf_counter(), []
    load = bench.busy_cpus(busy, max_seconds=4 * 3600) if busy else contextlib.nullcontext()  # as long as the run
    try:
        with load:
            execute.run(nb, path.parent, timeout_s, keep_going=keep_going)
    except (KeyboardInterrupt, TimeoutError, execute.CellError) as error:  # what ran so far is still worth reading
        reason = str(error).splitlines()[0] if str(error) else "interrupted"  # timeout -s INT stops a run so
        stopped = [f"ERROR after {time.perf_counter() - start:.0f} s: {reason}"]
    seconds = time.perf_counter() - start
    nbformat.write(nb, out / path.name)
    lines = [line for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
             for line in output.get("text", "").splitlines()]
    timed = sorted(((cell.metadata["seconds"], cell.get("id")) for cell in nb.cells if "seconds" in cell.metadata),
                   reverse=True)
    lines.append("slowest cells: " + ", ".join(f"{cell_id} {s:.1f} s" for s, cell_id in timed[:5]))
    errors = [f"ERROR in cell {index}: {output['ename']}: {output['evalue'][:300]}"
              for index, cell in enumerate(nb.cells) if cell.cell_type == "code"
              for output in cell.get("outputs", []) if output.get("output_type") == "error"]
    return seconds, lines + errors + stopped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the notebook (0: none)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/under_load"))
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may go without any output")
    parser.add_argument("--default-threads", action="store_true", help="keep torch's default thread count")
    parser.add_argument("--keep-going", action="store_true", help="run every cell even after one raises")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    threads = "torch's default threads" if args.default_threads else "threads chosen by the notebooks"
    gpu = f"  {device_name('cuda')}" if torch.cuda.is_available() else ""
    print(f"{datetime.date.today()}  {device_name('cpu')}{gpu}  torch {torch.__version__}  {args.busy} busy processes, "
          f"{threads}")
    for path in args.notebooks:
        seconds, lines = run(path, args.out, args.busy, args.timeout, args.default_threads, args.keep_going)
        print(f"\n== {path} ran in {seconds:.0f} s beside {args.busy} busy processes (executed copy: {args.out / path.name})")
        for line in lines:
            if INTERESTING.search(line):
                print("   " + line)


if __name__ == "__main__":
    main()
