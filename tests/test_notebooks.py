"""Every notebook runs top to bottom, as CI runs them (``make test``; ``make test-notebooks`` alone).

Each lab takes one kernel. First the instructor's copy runs whole with ``LABKIT_STRICT=1``, so a
failing inline check fails the run. Then, in the same kernel, the student's copy runs from its first
exercise cell to its end, in the student's folder, with every exercise still a stub: its checks must
say what is missing without raising, and every cell after them must cope with a stub.

The student's cells before its first exercise are the instructor's, byte for byte (release writes them
so; ``test_release`` checks that ``notebooks/`` is what release writes, and the run checks it again),
so the kernel already holds what they leave behind: running them again would repeat every demo for
nothing. What the instructor's exercises and the cells after them bound is taken away before the
student's copy runs, and the names they rebound get back what they held at the first exercise; an
object that a cell there changed in place stays changed. The student copy of 02 also runs whole in
JupyterLab (``tests/test_browser.py``).
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from labkit import execute, notebook

ROOT = Path(__file__).resolve().parent.parent
LABS = sorted(path.name for path in (ROOT / "solutions").glob("*.ipynb"))
# a cell silent this long stops the run; the whole lab, both copies, is bounded by pytest-timeout's limit
# (pyproject.toml), several times the longest lab's time beside another lab
CELL_TIMEOUT_S = 300
KEEP = "_names_at_the_first_exercise = dict(globals())"
# in a lambda, so that it binds no name of its own; IPython's hidden names (_, In, Out, ...) left to IPython
TURN = """\
(lambda names, kept, hidden: ([names.pop(name) for name in [n for n in names if n not in kept and n not in hidden]],
                              names.update({{name: value for name, value in kept.items() if name not in hidden}})))(
    globals(), globals().pop("_names_at_the_first_exercise"), get_ipython().user_ns_hidden)
__import__("os").chdir({folder!r})
__import__("os").environ["LABKIT_STRICT"] = "0"
"""


def _first_exercise(nb: nbformat.NotebookNode, name: str) -> int:
    for index, cell in enumerate(nb.cells):
        if notebook.exercise_id(cell) is not None:
            return index
    raise AssertionError(f"notebooks/{name} has no exercise cell")


def _one_run(root: Path, name: str) -> tuple[nbformat.NotebookNode, list[str]]:
    """The instructor's copy, with the names kept at its first exercise; a cell that restores them, turns
    to the student's folder and lets checks fail quietly; then the student's copy from its first
    exercise. With where each cell comes from."""
    solution = nbformat.read(root / "solutions" / name, as_version=4)
    student = nbformat.read(root / "notebooks" / name, as_version=4)
    first = _first_exercise(student, name)
    if [cell.source for cell in student.cells[:first]] != [cell.source for cell in solution.cells[:first]]:
        raise AssertionError(f"notebooks/{name} is not solutions/{name} before its first exercise: make release")
    for cell in student.cells:  # one notebook, so ids of their own
        cell.id = f"student-{cell.id}"
    keep = nbformat.v4.new_code_cell(KEEP)
    turn = nbformat.v4.new_code_cell(TURN.format(folder=str(root / "notebooks")))
    run = nbformat.v4.new_notebook(metadata=solution.metadata, cells=[
        *solution.cells[:first], keep, *solution.cells[first:], turn, *student.cells[first:]])
    origins = [*(f"solutions/{name} cell {i}" for i in range(first)), "the cell that keeps the names",
               *(f"solutions/{name} cell {i}" for i in range(first, len(solution.cells))),
               "the turn to the student copy",
               *(f"notebooks/{name} cell {i}" for i in range(first, len(student.cells)))]
    return run, origins


def run_lab(root: Path, name: str) -> nbformat.NotebookNode:
    """Run lab ``name``'s two notebooks under ``root`` in one kernel, as the module's docstring says;
    fail naming the notebook and cell that raised or went silent. The caller sets ``LABKIT_STRICT=1``."""
    run, origins = _one_run(root, name)
    try:
        execute.run(run, root / "solutions", timeout_s=CELL_TIMEOUT_S)
    except (execute.CellError, TimeoutError) as error:
        index = error.cell_index
        said = str(error).removeprefix(f"cell {index} ({run.cells[index].get('id')})")  # its place in the run
        pytest.fail(f"{origins[index]}{said}", pytrace=False)
    return run


@pytest.mark.notebook
@pytest.mark.parametrize("name", LABS)
def test_the_solution_runs_checks_strict_and_the_student_copy_runs_with_stubs(name, monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)  # pytest run from a notebook: its grade cells grade their own
    run_lab(ROOT, name)


def _lab(root: Path, solution: list[str], student: list[str]) -> str:
    """A lab of two tiny notebooks under ``root``: a heading, then the code cells given, the second
    the exercise; its name."""
    name = "00_tiny.ipynb"
    for folder, sources in (("solutions", solution), ("notebooks", student)):
        cells = [nbformat.v4.new_markdown_cell("# A tiny lab"), *map(nbformat.v4.new_code_cell, sources)]
        cells[2].metadata.update(tags=["exercise"], labkit={"exercise": "ex00.1"})
        (root / folder).mkdir(exist_ok=True)
        kernel = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nbformat.v4.new_notebook(cells=cells, metadata={"kernelspec": kernel}), root / folder / name)
    return name


WHERE = "import os\nprint(os.getcwd(), os.environ['LABKIT_STRICT'])"
SOLVED, STUB = "def f():\n    return 1", "def f():\n    raise NotImplementedError"


def test_the_student_copy_runs_from_its_first_exercise_in_its_folder_with_checks_quiet(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    prefix = WHERE + "\nx = 'the prefix'"
    name = _lab(tmp_path, [prefix, SOLVED, "x, y = 'the solution', 'the solution'", WHERE],
                [prefix, STUB, "print(x, 'y' in globals())", WHERE])
    printed = [execute.printed(nbformat.v4.new_notebook(cells=[cell])) for cell in run_lab(tmp_path, name).cells]
    solutions, notebooks = f"{tmp_path / 'solutions'} 1\n", f"{tmp_path / 'notebooks'} 0\n"
    assert printed == ["", solutions, "", "", "", solutions, "", "", "the prefix False\n", notebooks]


@pytest.mark.parametrize("solution, student, named", [
    (["x = 1", SOLVED, "print(f())"], ["x = 1", STUB, "print(f())"],
     "notebooks/00_tiny.ipynb cell 3 raised NotImplementedError"),
    (["x = 1", SOLVED, "assert f() == 2"], ["x = 1", STUB, "f"],
     "solutions/00_tiny.ipynb cell 3 raised AssertionError"),
])
def test_the_cell_that_raised_is_named_with_its_notebook(tmp_path, monkeypatch, solution, student, named):
    monkeypatch.setenv("LABKIT_STRICT", "1")
    with pytest.raises(pytest.fail.Exception, match=named):
        run_lab(tmp_path, _lab(tmp_path, solution, student))


def test_a_student_copy_that_is_not_the_solution_before_its_exercises_is_refused(tmp_path):
    name = _lab(tmp_path, ["x = 1", SOLVED], ["x = 2", STUB])
    with pytest.raises(AssertionError, match="notebooks/00_tiny.ipynb is not solutions/00_tiny.ipynb before"):
        run_lab(tmp_path, name)
