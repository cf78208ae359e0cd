"""Run a notebook top to bottom in a fresh Jupyter kernel, as "Restart and run all" does, and keep its outputs.

The cells go to the kernel through jupyter_client's blocking client, as nbval sends them, not
through nbclient's asyncio client. That one sometimes misses a reply that has already arrived and
reads it only when the cell's whole timeout has passed (pyzmq's asyncio poll misses the socket's
wake-up, then polls once more at the timeout): on the 2-core machine, 4 of 24 runs of a notebook of
41 widget cells stalled so, with ipykernel 7.4 and 6.31 alike, and the run went on as if nothing had
happened, its time and the cell's wrong. The blocking client polls the socket itself, and never
stalled in 20 runs of the same notebook. Used by ``benchmarks/notebooks_under_load.py`` and the
tests that run a notebook under their own settings.
"""
from __future__ import annotations

import queue
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager

OUTPUTS = {"stream", "display_data", "execute_result", "error"}  # what a cell shows; the rest is protocol


class CellError(RuntimeError):
    """A cell raised: its index, its id, and the kernel's traceback."""


def run(nb: nbformat.NotebookNode, cwd: Path, timeout_s: float, kernel_name: str | None = None,
        keep_going: bool = False) -> list[float]:
    """Run the code cells of ``nb`` in order in a new kernel started in ``cwd`` (inheriting this
    process's environment), filling each cell's outputs and its seconds (``cell.metadata["seconds"]``,
    there even when the run is interrupted); return each code cell's seconds. A cell that
    raises stops the run with ``CellError``, or with ``keep_going`` keeps its error as an output and the
    run goes on; one silent for ``timeout_s`` stops it with ``TimeoutError``. The kernel is the
    notebook's own (its kernelspec) unless ``kernel_name`` says, and is shut down however the run ends."""
    name = kernel_name or nb.metadata.get("kernelspec", {}).get("name", "python3")
    manager = KernelManager(kernel_name=name)
    manager.start_kernel(cwd=str(cwd))
    client = manager.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        return [_run_cell(client, cell, index, timeout_s, keep_going)
                for index, cell in enumerate(nb.cells) if cell.cell_type == "code"]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def printed(nb: nbformat.NotebookNode) -> str:
    """The text that the code cells of ``nb`` printed."""
    return "".join(output.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []) if output["output_type"] == "stream")


def _run_cell(client, cell: nbformat.NotebookNode, index: int, timeout_s: float, keep_going: bool) -> float:
    """Run one cell, its outputs read from the kernel's messages until it is idle again; its seconds."""
    started, request = time.perf_counter(), client.execute(cell.source)
    cell.outputs = []
    while True:
        try:
            message = client.get_iopub_msg(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"cell {index} ({cell.get('id')}): nothing from the kernel for {timeout_s} s") from None
        if message["parent_header"].get("msg_id") != request:
            continue
        kind, content = message["msg_type"], message["content"]
        if kind == "clear_output":
            cell.outputs = []
        elif kind in OUTPUTS:
            cell.outputs.append(nbformat.v4.output_from_msg(message))
        if kind == "error" and not keep_going:
            raise CellError(f"cell {index} ({cell.get('id')}) raised {content['ename']}: {content['evalue']}\n"
                            + "\n".join(content["traceback"]))
        if kind == "status" and content["execution_state"] == "idle":
            cell.metadata["seconds"] = time.perf_counter() - started
            return cell.metadata["seconds"]
