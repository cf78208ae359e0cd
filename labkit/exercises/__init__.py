"""Every graded exercise of the lab, by id. Each notebook's exercises live in ``labNN.py``."""
from __future__ import annotations

from labkit.exercises import lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab06b, lab07, lab08, lab09, lab10, lab11
from labkit.exercises.spec import Case, Exercise, Scenario

LABS = (lab00, lab01, lab02, lab03, lab04, lab05, lab06, lab06b, lab07, lab08, lab09, lab10, lab11)
EXERCISES: dict[str, Exercise] = {ex.id: ex for lab in LABS for ex in lab.EXERCISES}


def get(exercise_id: str) -> Exercise:
    """The exercise with this id, or a KeyError that lists the known ids."""
    try:
        return EXERCISES[exercise_id]
    except KeyError:
        raise KeyError(f"no exercise {exercise_id!r}; known: {', '.join(EXERCISES)}") from None


def for_lab(lab: str) -> list[Exercise]:
    """The exercises of notebook ``lab`` (e.g. ``"00"``), in order."""
    return [ex for ex in EXERCISES.values() if ex.lab == lab]


__all__ = ["Case", "Exercise", "Scenario", "EXERCISES", "get", "for_lab"]
