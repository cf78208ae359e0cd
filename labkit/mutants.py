"""Mutation testing of the exercise checks: which small slips in a solution does its check let through?

``python -m labkit.mutants [EXERCISE...]`` takes each exercise's cell in ``solutions/`` and makes one
small change at a time inside its solution regions (between ``### BEGIN SOLUTION`` and
``### END SOLUTION``): a comparison turned between ``<`` and ``<=`` (or ``==`` and ``!=``), an
arithmetic or bitwise operator swapped for its partner, a number moved up or down by one, ``and``
for ``or``, a unary operator dropped, a statement removed, a keyword argument left out (``dim=-1``,
``keepdim=True``, ``other=0.0``; not ``device=``, moot where a check's inputs are on the CPU), a function
called for its partner (``max`` for ``min``, ``amax`` for ``amin``, ``exp`` for ``exp2``, ``sum``
for ``mean``, ``tril`` for ``triu``: ``PARTNERS``), two neighbouring arguments of a call swapped
(not where their order is moot: ``SYMMETRIC``). It runs the exercise's check on each such
*mutant*, as ``labkit.check`` would on a student's cell. A mutant the check passes is one of two
things: the same computation written otherwise (an *equivalent* mutant: ``x.transpose(2, -1)`` for
``x.transpose(-2, -1)`` on a 4-d tensor), or a slip that no case sees, and so a case to add. It prints,
per exercise, how many mutants the check caught, and the changed line of each one it passed.
"""
from __future__ import annotations

import argparse
import ast
import copy
import linecache
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from labkit import notebook
from labkit.check import PASSED, Overtime, run_cases, time_limit
from labkit.exercises import EXERCISES, Exercise, get
from labkit.release import BEGIN, END

COMPARISONS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
               ast.NotEq: ast.Eq}
OPERATORS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
             ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
             ast.BitOr: ast.BitAnd}
PARTNERS = {"max": "min", "min": "max", "maximum": "minimum", "minimum": "maximum", "amax": "amin", "amin": "amax",
            "argmax": "argmin", "argmin": "argmax", "floor": "ceil", "ceil": "floor", "exp": "exp2", "exp2": "exp",
            "log": "log2", "log2": "log", "sum": "mean", "mean": "sum", "tril": "triu", "triu": "tril", "any": "all",
            "all": "any"}  # a function called for its partner: an attribute (torch.amax, tl.max) or a builtin (max)
SYMMETRIC = {"min", "max", "maximum", "minimum", "transpose", "swapaxes"}  # their arguments' order is moot
STATEMENTS = (ast.Expr, ast.Assign, ast.AugAssign, ast.Delete, ast.If, ast.Raise, ast.Return)
LIMIT_S = 20.0  # a mutant's check, at most (a mutant may loop for ever)


@dataclass(frozen=True)
class Mutant:
    """One change to a solution: what kind, the line before and after it, and the whole changed source."""

    kind: str
    before: str
    after: str
    source: str


def define(source: str, name: str) -> Any:
    """Run a cell's source and return what it defines as ``name``. The source goes into linecache, as
    IPython puts a cell's, so that Triton can read a kernel's source and an error can show its line."""
    filename = f"<exercise cell {name} {hash(source)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


def solution_cells(folder: Path) -> dict[str, str]:
    """The source of each exercise cell of the notebooks in ``folder``, by exercise id."""
    return {ex_id: notebook.source(cell) for path in sorted(folder.glob("*.ipynb"))
            for cell in notebook.read(path)["cells"] if (ex_id := notebook.exercise_id(cell)) is not None}


def _regions(source: str) -> list[range]:
    """The line numbers (from 1) of each solution region, its markers included."""
    lines = source.splitlines()
    begins = [n for n, line in enumerate(lines, 1) if line.strip().startswith(BEGIN)]
    ends = [n for n, line in enumerate(lines, 1) if line.strip().startswith(END)]
    return [range(begin, end + 1) for begin, end in zip(begins, ends)]


def _sites(tree: ast.AST, regions: list[range]) -> list[tuple[str, ast.AST, int]]:
    """Every change this module makes, in a fixed order: (kind, the node, which operand of a comparison)."""
    sites: list[tuple[str, ast.AST, int]] = []
    for node in ast.walk(tree):
        if not any(getattr(node, "lineno", 0) in region for region in regions):
            continue
        if isinstance(node, ast.Compare):
            sites += [("comparison", node, i) for i, op in enumerate(node.ops) if type(op) in COMPARISONS]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in OPERATORS:
            sites.append(("operator", node, 0))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
            sites += [("number + 1", node, 0), ("number - 1", node, 0)]
        elif isinstance(node, ast.BoolOp):
            sites.append(("and/or", node, 0))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
            sites.append(("unary dropped", node, 0))
        elif isinstance(node, ast.Call):
            sites += [("keyword dropped", node, i) for i, keyword in enumerate(node.keywords)
                      if keyword.arg not in (None, "device")]  # moot where a check's inputs are on the CPU
            if _called_name(node) in PARTNERS and _partner_exists(node):
                sites.append(("partner called", node, 0))
            if _called_name(node) not in SYMMETRIC:
                sites += [("arguments swapped", node, i) for i in range(len(node.args) - 1)
                          if not any(isinstance(a, ast.Starred) for a in node.args[i:i + 2])
                          and ast.dump(node.args[i]) != ast.dump(node.args[i + 1])]
        if isinstance(node, STATEMENTS) and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):
            sites.append(("statement removed", node, 0))  # a docstring's removal changes nothing
    return sites


def _called_name(call: ast.Call) -> str | None:
    """The name a call calls: ``amax`` in ``torch.amax(x)`` and ``x.amax()``, ``max`` in ``max(a, b)``."""
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _partner_exists(call: ast.Call) -> bool:
    """Whether the partner of a call through Triton's ``tl`` exists there (``tl.sum``'s, ``tl.mean``, does not:
    a mutant that cannot compile would count as caught); any other call's partner is taken to exist."""
    receiver = getattr(call.func, "value", None)
    if not (isinstance(receiver, ast.Name) and receiver.id == "tl"):
        return True
    from labkit.kernels import tl
    return tl is not None and hasattr(tl, PARTNERS[call.func.attr])


class _Replace(ast.NodeTransformer):
    """Put ``new`` where ``old`` was."""

    def __init__(self, old: ast.AST, new: ast.AST) -> None:
        self.old, self.new = old, new

    def visit(self, node: ast.AST) -> ast.AST:
        return self.new if node is self.old else self.generic_visit(node)


def _changed(node: ast.AST, kind: str, operand: int) -> ast.AST:
    """``node`` (a copy's, changed in place where it can be) with the change of ``kind`` made."""
    if kind == "comparison":
        node.ops[operand] = COMPARISONS[type(node.ops[operand])]()
    elif kind == "operator":
        node.op = OPERATORS[type(node.op)]()
    elif kind.startswith("number"):
        node.value += 1 if kind == "number + 1" else -1
    elif kind == "and/or":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "unary dropped":
        return node.operand
    elif kind == "keyword dropped":
        del node.keywords[operand]
    elif kind == "arguments swapped":
        node.args[operand], node.args[operand + 1] = node.args[operand + 1], node.args[operand]
    elif kind == "partner called":
        if isinstance(node.func, ast.Attribute):
            node.func.attr = PARTNERS[node.func.attr]
        else:
            node.func.id = PARTNERS[node.func.id]
    else:
        return ast.Pass()
    return node


def mutants(source: str) -> Iterator[Mutant]:
    """Each single change to the solution regions of ``source``, in a fixed order."""
    tree, regions = ast.parse(source), _regions(source)
    original = ast.unparse(tree).splitlines()
    for index in range(len(_sites(tree, regions))):
        copied = copy.deepcopy(tree)
        kind, node, operand = _sites(copied, regions)[index]
        changed = ast.fix_missing_locations(_Replace(node, _changed(node, kind, operand)).visit(copied))
        text = ast.unparse(changed)
        lines = text.splitlines()
        first = next((n for n, (a, b) in enumerate(zip(original, lines)) if a != b), min(len(original), len(lines)))
        yield Mutant(kind, original[first].strip() if first < len(original) else "",
                     lines[first].strip() if first < len(lines) else "", text)


def passes(exercise: Exercise, source: str, limit_s: float = LIMIT_S) -> bool:
    """Whether the exercise's check passes the cell ``source``; one that runs past ``limit_s`` or will not
    run fails."""
    try:
        with time_limit(limit_s):
            return run_cases(exercise, define(source, exercise.function)).status == PASSED
    except (Overtime, Exception):  # a cell that stops before its check runs is caught, whatever it raises
        return False


def survivors(exercise: Exercise, source: str, limit_s: float = LIMIT_S) -> tuple[int, list[Mutant]]:
    """How many mutants of ``source`` there are, and those the exercise's check passes. ValueError if the
    check does not pass ``source`` itself: every mutant would then fail it, and prove nothing."""
    if not passes(exercise, source, limit_s):
        raise ValueError(f"the check of {exercise.id} does not pass its solution: run labkit.check on it first")
    made = list(mutants(source))
    return len(made), [mutant for mutant in made if passes(exercise, mutant.source, limit_s)]


def _report(ex_id: str, total: int, passed: list[Mutant]) -> None:
    """How many mutants the check caught, and each changed line of those it passed."""
    print(f"{ex_id}: the check caught {total - len(passed)} of {total} mutants" + "; it passed these:" * bool(passed),
          flush=True)
    for mutant in passed:
        print(f"  {mutant.kind}\n    - {mutant.before}\n    + {mutant.after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("exercises", nargs="*", help="exercise ids, e.g. ex04.1 (default: every exercise)")
    parser.add_argument("--solutions", type=Path, default=Path(__file__).resolve().parent.parent / "solutions",
                        help="the instructor notebooks (default: the solutions folder beside labkit)")
    parser.add_argument("--limit", type=float, default=LIMIT_S, help=f"seconds per mutant (default {LIMIT_S:g})")
    args = parser.parse_args(argv)
    if not 0 < args.limit < math.inf:
        parser.error(f"--limit {args.limit:g}: give a number of seconds above 0")
    if unknown := [ex_id for ex_id in args.exercises if ex_id not in EXERCISES]:
        parser.error(f"no exercise {', '.join(unknown)}: choose among {', '.join(EXERCISES)}")
    if not args.solutions.is_dir():
        parser.error(f"--solutions {args.solutions} is not a folder of notebooks")
    cells, unchecked = solution_cells(args.solutions), []
    for ex_id in args.exercises or sorted(cells):
        if ex_id not in cells:
            unchecked.append(f"{ex_id}: no cell for it in {args.solutions}")
            continue
        try:
            _report(ex_id, *survivors(get(ex_id), cells[ex_id], args.limit))
        except ValueError as error:
            unchecked.append(f"{ex_id}: {error}")
    for line in unchecked:
        print(f"not checked: {line}", file=sys.stderr)
    return 1 if unchecked else 0


if __name__ == "__main__":
    sys.exit(main())
