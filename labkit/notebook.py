"""Notebooks as data: read, write and query .ipynb files without a kernel.

Files are written the way Jupyter writes them (sorted keys, one-space indent, sources as
lists of lines), so a notebook saved by JupyterLab and one written here diff cleanly.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

Notebook = dict[str, Any]
Cell = dict[str, Any]


def read(path: str | Path) -> Notebook:
    """Load a notebook; a file that is not notebook JSON gets an error naming it."""
    path = Path(path)
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a readable notebook: {error}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        raise ValueError(f"{path} is not a notebook: it has no list of cells")
    return nb


def dumps(nb: Notebook) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def write(nb: Notebook, path: str | Path) -> None:
    Path(path).write_text(dumps(nb), encoding="utf-8")


def source(cell: Cell) -> str:
    """A cell's source as one string (Jupyter stores a string or a list of lines)."""
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def set_source(cell: Cell, text: str) -> None:
    cell["source"] = text.splitlines(keepends=True)


def tags(cell: Cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def exercise_id(cell: Cell) -> str | None:
    """The id of the exercise a cell holds (``metadata.labkit.exercise``), if it is one."""
    if cell.get("cell_type") != "code" or "exercise" not in tags(cell):
        return None
    return cell.get("metadata", {}).get("labkit", {}).get("exercise")


def code_cells(nb: Notebook, tag: str) -> list[Cell]:
    return [c for c in nb["cells"] if c.get("cell_type") == "code" and tag in tags(c)]


def lab_of_name(name: str) -> str | None:
    """The notebook number a file name gives: ``03_paged-Copy1.ipynb`` -> ``03``, ``06b_fast.ipynb`` ->
    ``06b`` (a second notebook of lab 06); None for a name that starts with no number."""
    match = re.match(r"(\d\d[a-z]?)_", name)
    return match.group(1) if match else None
