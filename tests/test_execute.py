"""labkit.execute runs a notebook's code cells in order in a fresh kernel, keeps what they show, stops at the
first error (or keeps going when asked), and gives up on a silent cell after its timeout."""
from __future__ import annotations

import time

import nbformat
import pytest

from labkit import execute


def notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# not run")] + [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def test_cells_run_in_order_in_the_folder_given_and_keep_their_outputs(tmp_path):
    (tmp_path / "here.txt").write_text("found")
    nb = notebook("x = 6 * 7\nprint('first', x)", "from IPython.display import clear_output\nprint('gone')\n"
                  "clear_output()\nprint(open('here.txt').read())", "x + 1")
    seconds = execute.run(nb, tmp_path, timeout_s=60, kernel_name="python3")
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert seconds == [cell.metadata["seconds"] for cell in nb.cells[1:]]
    assert execute.printed(nb) == "first 42\nfound\n"
    assert nb.cells[3].outputs[0]["output_type"] == "execute_result" and nb.cells[3].outputs[0]["data"]["text/plain"] == "43"


def test_an_error_stops_the_run_naming_its_cell_unless_told_to_keep_going(tmp_path):
    with pytest.raises(execute.CellError, match=r"cell 2 \(.*\) raised ZeroDivisionError") as raised:
        execute.run(notebook("print('ran')", "1 / 0", "print('never')"), tmp_path, timeout_s=60, kernel_name="python3")
    assert raised.value.cell_index == 2  # in nb.cells, the markdown cell counted
    nb = notebook("1 / 0", "print('after')")
    execute.run(nb, tmp_path, timeout_s=60, kernel_name="python3", keep_going=True)
    assert nb.cells[1].outputs[0]["ename"] == "ZeroDivisionError" and execute.printed(nb) == "after\n"


def test_a_silent_cell_times_out(tmp_path):
    started = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"cell 1 .*nothing from the kernel for 1 s") as raised:
        execute.run(notebook("import time\ntime.sleep(30)"), tmp_path, timeout_s=1, kernel_name="python3")
    assert raised.value.cell_index == 1
    assert time.perf_counter() - started < 20


def test_a_kernel_that_dies_or_asks_for_input_stops_the_run_at_once(tmp_path):
    started = time.perf_counter()
    with pytest.raises(execute.CellError, match=r"cell 1 .*the kernel died"):
        execute.run(notebook("import os\nos._exit(1)"), tmp_path, timeout_s=60, kernel_name="python3")
    with pytest.raises(execute.CellError, match=r"cell 1 .*raised StdinNotImplementedError"):
        execute.run(notebook("input('name? ')"), tmp_path, timeout_s=60, kernel_name="python3")
    assert time.perf_counter() - started < 30


def test_clear_output_with_wait_keeps_the_old_outputs_until_a_new_one(tmp_path):
    nb = notebook("from IPython.display import clear_output\nprint('old')\nclear_output(wait=True)",
                  "from IPython.display import clear_output\nprint('old')\nclear_output(wait=True)\nprint('new')")
    execute.run(nb, tmp_path, timeout_s=60, kernel_name="python3")
    assert [execute.printed(nbformat.v4.new_notebook(cells=[cell])) for cell in nb.cells[1:]] == ["old\n", "new\n"]


def test_the_kernel_is_asked_to_shut_down_so_the_notebooks_exit_handlers_run(tmp_path):
    """As Jupyter's restart does: labkit.background stops the servers a notebook started in such a handler."""
    execute.run(notebook("import atexit, pathlib\natexit.register(pathlib.Path('stopped.txt').write_text, 'yes')"),
                tmp_path, timeout_s=60, kernel_name="python3")
    assert (tmp_path / "stopped.txt").read_text() == "yes"
