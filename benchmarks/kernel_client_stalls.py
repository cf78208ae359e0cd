"""How often a notebook runner waits for a reply that has already arrived: nbclient's asyncio client against
the blocking client of ``labkit.execute``.

    python benchmarks/kernel_client_stalls.py [--runs 12] [--cells 40] [--timeout 30]

Each run executes, in a fresh kernel, a notebook of ``--cells`` cells that each show an ipywidgets
``interact`` with a small matplotlib plot (what the lab's Explore cells do), and counts the cells that took
longer than ``--timeout`` minus one second: a cell here takes well under a second, so such a cell waited
for its timeout. nbclient does not fail such a cell: when its timeout passes, pyzmq polls the socket
once more, finds the reply that had been waiting, and the run goes on with that cell's time wrong.
(nbclient is no dependency of labkit's own; it comes with JupyterLab, through nbconvert.)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from labkit import execute

CELL = """def show(a=1.0, b=3):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(np.arange(50) ** a * b)
    plt.show()
    print(a, b)
widgets.interact(show, a=widgets.FloatSlider(min=0.5, max=2.0, value=1.0), b=widgets.IntSlider(min=1, max=9, value=3));
print("cell {index}")"""


def widget_notebook(cells: int) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import ipywidgets as widgets\nimport matplotlib.pyplot as plt\n"
                                          "import numpy as np\n%matplotlib inline")]
    nb.cells += [nbformat.v4.new_code_cell(CELL.format(index=i)) for i in range(cells)]
    return nb


def with_nbclient(nb: nbformat.NotebookNode, folder: Path, timeout_s: int) -> list[float]:
    """Each code cell's seconds, run by nbclient."""
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    seconds = []
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            started = time.perf_counter()
            client.execute_cell(cell, index)
            seconds.append(time.perf_counter() - started)
    return seconds


def with_blocking_client(nb: nbformat.NotebookNode, folder: Path, timeout_s: int) -> list[float]:
    return execute.run(nb, folder, timeout_s, kernel_name="python3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--cells", type=int, default=40)
    parser.add_argument("--timeout", type=int, default=30, help="seconds a cell may wait for the kernel")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        for name, runner in (("nbclient (asyncio)", with_nbclient), ("labkit.execute (blocking)", with_blocking_client)):
            stalled_runs, stalled_cells, started = 0, 0, time.perf_counter()
            for _ in range(args.runs):
                seconds = runner(widget_notebook(args.cells), Path(folder), args.timeout)
                stalls = sum(s > args.timeout - 1 for s in seconds)
                stalled_runs, stalled_cells = stalled_runs + (stalls > 0), stalled_cells + stalls
            print(f"{name:<27} {stalled_runs} of {args.runs} runs stalled, {stalled_cells} of "
                  f"{args.runs * (args.cells + 1)} cells waited their {args.timeout} s timeout; "
                  f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
