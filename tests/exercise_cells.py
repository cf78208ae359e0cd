"""The exercise cells of the notebooks, and running one to get what it defines."""
from __future__ import annotations

import linecache

from labkit import notebook, release
from labkit.check import FAILED, run_cases
from labkit.exercises import get


def cells(folder, root) -> dict[str, str]:
    cells = {}
    for path in sorted((root / folder).glob("*.ipynb")):
        for cell in notebook.read(path)["cells"]:
            if (ex_id := notebook.exercise_id(cell)) is not None:
                assert ex_id not in cells, f"{ex_id} appears twice in {folder}/"
                assert path.name.startswith(get(ex_id).lab + "_"), f"{ex_id} sits in {path.name}"
                cells[ex_id] = notebook.source(cell)
    for ex_id, source in pending_cells(root).items():
        assert ex_id not in cells, f"{ex_id} is in {folder}/ now: delete its cell from tests/pending_cells/"
        cells[ex_id] = source if folder == "solutions" else release.strip_solutions(source, ex_id, "pending cell")
    return cells


def pending_cells(root) -> dict[str, str]:
    """The exercise cells of notebooks not written yet: tests/pending_cells/NN_name.py holds each cell of
    solutions/NN_name.ipynb after a line ``# %% exNN.M``; its release is the cell in notebooks/."""
    return {ex_id: source for path in _pending_files(root) for ex_id, source in _pending_in(path).items()}


def _pending_files(root) -> list:
    return sorted((root / "tests" / "pending_cells").glob("*.py"))


def _pending_in(path) -> dict[str, str]:
    cells, ex_id = {}, None
    for line in path.read_text().splitlines(keepends=True):
        if line.startswith("# %% "):
            ex_id = line.removeprefix("# %% ").strip()
            assert ex_id not in cells and path.name.startswith(get(ex_id).lab + "_"), (ex_id, path.name)
            cells[ex_id] = ""
        elif ex_id is not None:
            cells[ex_id] += line
    return {ex_id: source.strip() + "\n" for ex_id, source in cells.items()}


def solutions_with_pending(root, folder):
    """``folder``, made to hold links to the notebooks of solutions/ and, for each file of tests/pending_cells/,
    a notebook of its exercise cells: what the grader grades as solutions/ once those notebooks are written."""
    folder.mkdir(parents=True)
    for path in sorted((root / "solutions").glob("*.ipynb")):
        (folder / path.name).symlink_to(path)
    for path in _pending_files(root):
        cells = [{"cell_type": "code", "execution_count": None, "id": ex_id.replace(".", "-"), "outputs": [],
                  "metadata": {"tags": ["exercise"], "labkit": {"exercise": ex_id}}, "source": []}
                 for ex_id in _pending_in(path)]
        for cell, source in zip(cells, _pending_in(path).values()):
            notebook.set_source(cell, source)
        notebook.write({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5},
                       folder / path.with_suffix(".ipynb").name)
    return folder


def define(source: str, name: str):
    """Run an exercise cell and return what it defines as ``name``. The cell's source goes into
    linecache, as IPython puts it, so that Triton can read a kernel's source."""
    filename = f"<exercise cell {name} {hash(source)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def fails(ex_id: str, fn, case: str, hint: str):
    """``fn`` fails ``ex_id`` first at the case whose label starts with ``case``, and the message holds ``hint``."""
    result = run_cases(get(ex_id), fn)
    assert result.status == FAILED, (ex_id, case, result.verdict())
    first = result.message.split("case ", 1)[1]
    assert first.split("(", 1)[1].startswith(case), (case, result.message)
    assert hint in result.message, (hint, result.message)
    return result


def mistake(root, ex_id: str, right, wrong):
    """The solution of ``ex_id`` with ``right`` replaced by ``wrong`` (or each of several, given as tuples)."""
    source = cells("solutions", root)[ex_id]
    for r, w in zip(*((right, wrong) if isinstance(right, tuple) else ((right,), (wrong,)))):
        assert r in source, (ex_id, r)
        source = source.replace(r, w)
    return define(source, get(ex_id).function)
