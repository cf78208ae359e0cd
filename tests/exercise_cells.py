"""The exercise cells of the notebooks, and running one to get what it defines."""
from __future__ import annotations

from pathlib import Path

from labkit import notebook
from labkit.check import FAILED, run_cases
from labkit.exercises import get
from labkit.mutants import define


def cells(folder, root) -> dict[str, str]:
    cells = {}
    for path in sorted((root / folder).glob("*.ipynb")):
        for cell in notebook.read(path)["cells"]:
            if (ex_id := notebook.exercise_id(cell)) is not None:
                assert ex_id not in cells, f"{ex_id} appears twice in {folder}/"
                assert path.name.startswith(get(ex_id).lab + "_"), f"{ex_id} sits in {path.name}"
                cells[ex_id] = notebook.source(cell)
    return cells


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


def solution(ex_id: str):
    """What the solutions notebook's cell of ``ex_id`` defines: a right answer to build mistakes on. Not
    labkit's own: that refuses to be called from a student's function while its exercise is checked."""
    return define(cells("solutions", Path(__file__).resolve().parent.parent)[ex_id], get(ex_id).function)
