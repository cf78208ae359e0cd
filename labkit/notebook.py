"""Notebooks as data: read, write and query .ipynb files without a kernel.

Files are written the way Jupyter writes them (sorted keys, one-space indent, sources as
lists of lines), so a notebook saved by JupyterLab and one written here diff cleanly.
"""
from __future__ import annotations

import ast
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


def as_run(source: str) -> str:
    """A cell's source as IPython runs it, and as linecache keeps it: magics made calls, each line ended by one
    newline (a cell typed in JupyterLab lacks the last when saved; one saved on Windows may end them in \\r\\n)."""
    from IPython.core.inputtransformer2 import TransformerManager  # the kernel's: installed with the lab

    return "".join(line + "\n" for line in TransformerManager().transform_cell(source).splitlines())


def bound_names(code: str) -> set[str]:
    """The names a cell's code binds at its top level, as the notebook's namespace gets them: imports,
    functions, classes and assignments (not the names local to a function or a comprehension), and the
    attributes it assigns to a name's object, dotted (``Int4Packer.unpack = ...``: ``Int4Packer.unpack``).
    IPython's own syntax is read as IPython runs it: ``files = !ls`` binds ``files``, and the code that ``%time``, ``%prun``,
    ``%%time``, ``%%capture`` and ``%%prun`` run binds its names; other magics bind none. A cell that does
    not parse binds none."""
    first, _, body = code.lstrip().partition("\n")
    if first.startswith("%%"):  # a cell magic: the cell's body is its argument
        magic, *args = first[2:].split()
        captured = {args[-1]} if magic == "capture" and args and args[-1].isidentifier() else set()  # %%capture out
        return bound_names(body) | captured if magic in _RUN_HERE else set()
    lines = [_MAGIC_STATEMENT.sub(r"\1\3", line) for line in code.split("\n")]
    try:
        tree = ast.parse(as_run("\n".join(lines)))
    except SyntaxError:
        return set()
    binder = _Binder()
    binder.visit(tree)
    return binder.names


_RUN_HERE = {"time", "capture", "prun"}  # magics that run their code in the notebook's namespace
_MAGIC_STATEMENT = re.compile(r"^(\s*)%(time|prun)\s+(.*)$")  # a line magic that runs the statement after it


class _Binder(ast.NodeVisitor):
    """Collects the module-level names a tree binds."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Import(self, node: ast.Import) -> None:
        self.names.update(alias.asname or alias.name.split(".")[0] for alias in node.names)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.names.update(alias.asname or alias.name for alias in node.names if alias.name != "*")

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.names.add(node.name)  # its body's names are its own

    visit_AsyncFunctionDef = visit_ClassDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        pass

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self.visit(node.iter)  # its target is the comprehension's own
        for condition in node.ifs:
            self.visit(condition)

    def visit_ExceptHandler(self, node: ast.ExceptHandler) -> None:
        if node.name:
            self.names.add(node.name)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self.names.add(node.id)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):  # Int4Packer.unpack = ...
            self.names.add(f"{node.value.id}.{node.attr}")
        self.generic_visit(node)
