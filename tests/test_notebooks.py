"""Every notebook runs top to bottom, as CI runs them (``make test-notebooks``).

Each lab takes one kernel. First the instructor's copy runs whole with ``LABKIT_STRICT=1``, so a
failing inline check fails the run. Then, in the same kernel, the student's copy runs from its first
exercise cell to its end, in the student's folder, with every exercise still a stub: its checks must
say what is missing without raising, and every cell after them must cope with a stub.

The student's cells before its first exercise are the instructor's, byte for byte (release writes them
so, and ``test_release`` checks that ``notebooks/`` is what release writes), so the kernel already
holds what they leave behind; running them again would repeat every demo for nothing. The student
copy of 02 also runs whole in JupyterLab (``tests/test_browser.py``).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit import execute, notebook

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(path.name for path in (ROOT / "solutions").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # a cell silent this long stops the run; a whole CPU notebook takes under 90 s


def _first_exercise(nb: nbformat.NotebookNode, name: str) -> int:
    for index, cell in enumerate(nb.cells):
        if notebook.exercise_id(cell) is not None:
            return index
    raise AssertionError(f"notebooks/{name} has no exercise cell")


def _one_run(root: Path, name: str) -> tuple[nbformat.NotebookNode, list[str]]:
    """The instructor's copy, a cell that turns to the student's folder and lets checks fail quietly,
    then the student's copy from its first exercise; with where each code cell comes from."""
    solution = nbformat.read(root / "solutions" / name, as_version=4)
    student = nbformat.read(root / "notebooks" / name, as_version=4)
    first = _first_exercise(student, name)
    for cell in student.cells:  # one notebook, so ids of their own
        cell.id = f"student-{cell.id}"
    turn = nbformat.v4.new_code_cell(f"__import__('os').chdir({str(root / 'notebooks')!r})\n"
                                     "__import__('os').environ['LABKIT_STRICT'] = '0'")
    run = nbformat.v4.new_notebook(metadata=solution.metadata,
                                   cells=solution.cells + [turn] + student.cells[first:])
    origins = ([f"solutions/{name} cell {i}" for i in range(len(solution.cells))]
               + ["the turn to the student copy"]
               + [f"notebooks/{name} cell {i}" for i in range(first, len(student.cells))])
    return run, [origin for origin, cell in zip(origins, run.cells) if cell.cell_type == "code"]


def run_lab(root: Path, name: str) -> nbformat.NotebookNode:
    """Run lab ``name``'s two notebooks under ``root`` in one kernel, as the module's docstring says;
    fail naming the notebook and cell that raised or went silent. The caller sets ``LABKIT_STRICT=1``."""
    run, origins = _one_run(root, name)
    try:
        execute.run(run, root / "solutions", timeout_s=CELL_TIMEOUT_S)
    except (execute.CellError, TimeoutError) as error:
        code = [cell for cell in run.cells if cell.cell_type == "code"]
        failed = next(i for i, cell in enumerate(code) if "seconds" not in cell.metadata)
        said = str(error).removeprefix(f"cell {failed} ({code[failed].get('id')})")  # its index in the run
        pytest.fail(f"{origins[failed]}{said}", pytrace=False)
    return run


@pytest.mark.notebook
@pytest.mark.parametrize("name", LABS)
def test_the_solution_runs_checks_strict_and_the_student_copy_runs_with_stubs(name, monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    run_lab(ROOT, name)


def _lab(root: Path, solution: list[str], student: list[str]) -> str:
    """A lab of two tiny notebooks under ``root``, cell 1 of each its exercise; its name."""
    name = "00_tiny.ipynb"
    for folder, sources in (("solutions", solution), ("notebooks", student)):
        cells = [nbformat.v4.new_code_cell(source) for source in sources]
        cells[1].metadata.update(tags=["exercise"], labkit={"exercise": "ex00.1"})
        (root / folder).mkdir(exist_ok=True)
        nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}}),
                       root / folder / name)
    return name


def test_the_student_copy_runs_from_its_first_exercise_in_its_folder_with_checks_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    where = "import os\nprint(os.getcwd(), os.environ['LABKIT_STRICT'])"
    name = _lab(tmp_path, [where, "def f():\n    return 1", where],
                ["raise RuntimeError('the prefix ran twice')", "def f():\n    raise NotImplementedError", where])
    printed = [execute.printed(nbformat.v4.new_notebook(cells=[cell]))
               for cell in run_lab(tmp_path, name).cells]
    assert printed == [f"{tmp_path / 'solutions'} 1\n", "", f"{tmp_path / 'solutions'} 1\n", "", "",
                       f"{tmp_path / 'notebooks'} 0\n"]


@pytest.mark.parametrize("solution, student, named", [
    (["x = 1", "def f():\n    return 1", "print(f())"], ["x = 1", "def f():\n    raise NotImplementedError", "print(f())"],
     "notebooks/00_tiny.ipynb cell 2 raised NotImplementedError"),
    (["x = 1", "def f():\n    return 1", "assert f() == 2"], ["x = 1", "def f():\n    raise NotImplementedError", "f"],
     "solutions/00_tiny.ipynb cell 2 raised AssertionError"),
])
def test_the_cell_that_raised_is_named_with_its_notebook(tmp_path, monkeypatch, solution, student, named):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    with pytest.raises(pytest.fail.Exception, match=named):
        run_lab(tmp_path, _lab(tmp_path, solution, student))
