"""The exercise cells of the notebooks, and running one to get what it defines."""
from __future__ import annotations

import linecache

from labkit import notebook
from labkit.exercises import get


def cells(folder, root) -> dict[str, str]:
    cells = {}
    for path in sorted((root / folder).glob("*.ipynb")):
        for cell in notebook.read(path)["cells"]:
            if (ex_id := notebook.exercise_id(cell)) is not None:
                assert ex_id not in cells, f"{ex_id} appears twice in {folder}/"
                assert path.name.startswith(get(ex_id).lab + "_"), f"{ex_id} sits in {path.name}"
                cells[ex_id] = notebook.source(cell)
    return cells


def define(source: str, name: str):
    """Run an exercise cell and return what it defines as ``name``. The cell's source goes into
    linecache, as IPython puts it, so that Triton can read a kernel's source."""
    filename = f"<exercise cell {name} {hash(source)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]
