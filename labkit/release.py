"""Write the student notebooks from the instructor notebooks.

``python -m labkit.release`` turns each ``solutions/NN_name.ipynb`` into
``notebooks/NN_name.ipynb``: in every cell tagged ``exercise`` the lines between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` become one ``raise NotImplementedError(...)``
at the same indentation; every output is cleared, and of the metadata only the tags, the exercise
ids, the kernel and the language stay. ``--check`` writes nothing and exits 1
when notebooks/ is not what a release would write.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

from labkit import notebook
from labkit.exercises import EXERCISES

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
# the metadata a student copy keeps; the rest is the instructor's editor state (hidden sources,
# timings, scroll state, widget state), which has no place in it
CELL_METADATA, NOTEBOOK_METADATA = ("tags", "labkit"), ("kernelspec", "language_info")


def strip_solutions(text: str, exercise: str, where: str) -> str:
    """Replace each BEGIN/END SOLUTION region of ``text`` by a stub that raises."""
    out, inside = [], False
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        marker = line.strip()
        if marker.startswith(BEGIN) or marker.startswith(END):
            marker = BEGIN if marker.startswith(BEGIN) else END  # "### END SOLUTION  # note" counts too
        elif BEGIN in line or END in line:
            raise ValueError(f"{where}: line {number} has a solution marker that is not alone on its line")
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}: line {number} opens a solution inside another one")
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f'{indent}raise NotImplementedError("{exercise}: replace this line with your code")\n')
            inside = True
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}: line {number} closes a solution that was never opened")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: a solution is opened with {BEGIN!r} but never closed with {END!r}")
    return "".join(out)


def _release_cell(cell: notebook.Cell, where: str) -> None:
    text = notebook.source(cell)
    exercise = notebook.exercise_id(cell)
    if exercise is None:
        if BEGIN in text or END in text:
            raise ValueError(f"{where}: solution markers in a cell that is not tagged 'exercise' "
                             "with metadata labkit.exercise")
    else:
        if exercise not in EXERCISES:
            raise ValueError(f"{where}: exercise {exercise!r} is not defined in labkit.exercises")
        if BEGIN not in text:
            raise ValueError(f"{where}: exercise {exercise} has no {BEGIN!r} region to release")
        notebook.set_source(cell, strip_solutions(text, exercise, where))
    cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in CELL_METADATA}
    if cell.get("cell_type") == "code":
        cell["outputs"], cell["execution_count"] = [], None


def release_notebook(nb: notebook.Notebook, name: str) -> notebook.Notebook:
    """The student copy of an instructor notebook."""
    student = copy.deepcopy(nb)
    student["metadata"] = {k: v for k, v in student.get("metadata", {}).items() if k in NOTEBOOK_METADATA}
    if "language_info" in student["metadata"]:  # its name, not the instructor's Python version
        student["metadata"]["language_info"] = {"name": student["metadata"]["language_info"].get("name", "python")}
    for index, cell in enumerate(student["cells"]):
        _release_cell(cell, f"{name} cell {index}")
    return student


def planned(solutions: Path, notebooks: Path) -> dict[Path, str]:
    """Every student notebook a release writes, with its text."""
    sources = sorted(p for p in solutions.glob("*.ipynb") if notebook.lab_of_name(p.name))
    if not sources:
        raise FileNotFoundError(f"no instructor notebooks (NN_name.ipynb) in {solutions}")
    return {notebooks / src.name: notebook.dumps(release_notebook(notebook.read(src), src.name))
            for src in sources}


def stale(solutions: Path, notebooks: Path) -> list[str]:
    """What differs between notebooks/ and a fresh release, one line each."""
    plan = planned(solutions, notebooks)
    problems = [f"{path} is out of date" for path, text in plan.items()
                if not path.exists() or path.read_text(encoding="utf-8") != text]
    problems += [f"{path} has no instructor notebook in {solutions}"
                 for path in sorted(notebooks.glob("*.ipynb")) if notebook.lab_of_name(path.name) and path not in plan]
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.release",
                                     description=__doc__.split("\n\n")[0].replace("``", ""))
    parser.add_argument("--solutions", type=Path, default=Path("solutions"),
                        help="the instructor notebooks to read (default: solutions)")
    parser.add_argument("--notebooks", type=Path, default=Path("notebooks"),
                        help="where the student copies go (default: notebooks)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if notebooks/ is stale")
    args = parser.parse_args(argv)
    if not args.solutions.is_dir():
        parser.error(f"--solutions {args.solutions} is not a folder of instructor notebooks")
    if args.notebooks.resolve() == args.solutions.resolve():  # the stubs would overwrite the answers
        parser.error(f"--notebooks {args.notebooks} is the --solutions folder: the student copies would replace the "
                     "instructor notebooks")
    if args.notebooks.exists() and not args.notebooks.is_dir():
        parser.error(f"--notebooks {args.notebooks} is a file, not a folder")
    if args.check:
        problems = stale(args.solutions, args.notebooks)
        for line in problems:
            print(line)
        print(f"{args.notebooks} is stale: run python -m labkit.release" if problems
              else f"{args.notebooks} is up to date")
        return 1 if problems else 0
    plan = planned(args.solutions, args.notebooks)  # before any folder is made: no instructor notebook, no folder
    args.notebooks.mkdir(parents=True, exist_ok=True)
    for path, text in plan.items():
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
