"""Run a notebook top to bottom in a fresh Jupyter kernel, as "Restart and run all" does, and keep its outputs.

The cells go to the kernel through jupyter_client's blocking client, not through nbclient's asyncio
client. That one sometimes misses a reply that has already arrived and reads it only when the
cell's whole timeout has passed (pyzmq's asyncio poll misses the socket's wake-up, then polls once
more at the timeout), and the run goes on as if nothing had happened, its time and the cell's wrong.
The blocking client polls the socket itself and did not stall (``benchmarks/kernel_client_stalls.py``;
BENCHMARKS.md, "Running a notebook"). Used by ``benchmarks/notebooks_under_load.py``,
``benchmarks/gpu_session.sh``, CI's run of every notebook (``tests/test_notebooks.py``) and the tests
that run a notebook under their own settings.
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
    there even when the run is interrupted); return each code cell's seconds. A cell that raises, asks
    for input or kills the kernel stops the run with ``CellError``; with ``keep_going`` a cell's error
    stays as its output and the run goes on. A cell silent for ``timeout_s`` stops it with
    ``TimeoutError``. Either error carries the cell's index in ``nb.cells`` as ``cell_index``. The
    kernel is the notebook's own (its kernelspec) unless ``kernel_name`` says, and is shut down however
    the run ends: asked first, as Jupyter's restart asks, so that what the notebook started is stopped
    by its exit handlers (a server of ``labkit.background``), then killed if it has not gone within
    jupyter_client's wait."""
    name = kernel_name or nb.metadata.get("kernelspec", {}).get("name", "python3")
    manager = KernelManager(kernel_name=name)
    manager.start_kernel(cwd=str(cwd))
    client = manager.client()
    try:
        client.start_channels()
        client.wait_for_ready(timeout=60)
        seconds = []
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code":
                try:
                    seconds.append(_run_cell(client, manager, cell, index, timeout_s, keep_going))
                except (CellError, TimeoutError) as error:
                    error.cell_index = index
                    raise
        return seconds
    finally:
        client.stop_channels()
        manager.shutdown_kernel()


def printed(nb: nbformat.NotebookNode) -> str:
    """The text that the code cells of ``nb`` printed."""
    return "".join(output.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []) if output["output_type"] == "stream")


def _run_cell(client, manager: KernelManager, cell: nbformat.NotebookNode, index: int, timeout_s: float,
              keep_going: bool) -> float:
    """Run one cell, its outputs read from the kernel's messages until it is idle again; its seconds."""
    where = f"cell {index} ({cell.get('id')})"
    started, request = time.perf_counter(), client.execute(cell.source, allow_stdin=False)
    cell.outputs, clear_before_next = [], False
    while True:
        message = _next_message(client, manager, request, timeout_s, where)
        kind, content = message["msg_type"], message["content"]
        if kind == "clear_output":  # with wait, the old outputs stay until a new one comes, as in Jupyter
            cell.outputs, clear_before_next = ([], False) if not content.get("wait") else (cell.outputs, True)
        elif kind in OUTPUTS:
            cell.outputs = ([] if clear_before_next else cell.outputs) + [nbformat.v4.output_from_msg(message)]
            clear_before_next = False
        if kind == "error" and not keep_going:
            raise CellError(f"{where} raised {content['ename']}: {content['evalue']}\n" + "\n".join(content["traceback"]))
        if kind == "status" and content["execution_state"] == "idle":
            cell.metadata["seconds"] = time.perf_counter() - started
            return cell.metadata["seconds"]


def _next_message(client, manager: KernelManager, request: str, timeout_s: float, where: str) -> dict:
    """The kernel's next message about ``request``, looked for a second at a time, so that a kernel that
    died is named at once rather than after ``timeout_s`` of silence."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            message = client.get_iopub_msg(timeout=1)
        except queue.Empty:
            if not manager.is_alive():
                raise CellError(f"{where}: the kernel died (out of memory, a crash in native code, or os._exit)") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"{where}: nothing from the kernel for {timeout_s} s") from None
            continue
        if message["parent_header"].get("msg_id") == request:
            return message
