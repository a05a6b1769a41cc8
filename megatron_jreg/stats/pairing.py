"""What pairing scores by seed leaves out, said instead of dropped.

A paired test uses the seeds scored on both sides. A run of one side without its twin (a
baseline seed with no JREG run), a task one side of a seed has and the other lacks, and
a seed scored on some tasks only (the per-seed average over tasks needs every task)
would each shrink ``n`` without a word. :meth:`LeftOut.refusal` names them all in one
line (the tools refuse such scores unless ``--allow-unpaired`` accepts them); with the
flag the output lists them (:meth:`LeftOut.lines`) and the JSON holds them
(:meth:`LeftOut.to_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List

SIDES = ("baseline", "jreg")
_SHOWN = {"baseline": "baseline", "jreg": "JREG"}


def ordered(keys: Iterable[str]) -> List[str]:
    """Seeds in numeric order where they are numbers (2 before 10), else as text."""
    return sorted(keys, key=lambda k: (0, int(k), "") if k.isdigit() else (1, 0, k))


def _other(side: str) -> str:
    return _SHOWN[SIDES[1 - SIDES.index(side)]]


@dataclass
class LeftOut:
    """The scores a paired comparison cannot use. ``unit`` names a key: ``seed``, or
    ``report`` when reports without a seed pair in the order given."""

    unit: str = "seed"
    runs: Dict[str, List[str]] = field(default_factory=dict)
    """side -> the keys that side has and the other side has not"""
    tasks: Dict[str, Dict[str, List[str]]] = field(default_factory=dict)
    """task -> side -> the keys (paired otherwise) scored on that task by that side only"""
    average: List[str] = field(default_factory=list)
    """the keys not scored on every task: in the per-task tests, not in the average"""
    no_average: bool = False
    """fewer than two keys are scored on every task: there is no average over tasks"""

    def __bool__(self) -> bool:
        return bool(self.items())

    def _keys(self, keys: List[str]) -> str:
        return f"{self.unit}{'s' if len(keys) > 1 else ''} {', '.join(keys)}"

    def items(self) -> List[str]:
        """One phrase per thing left out."""
        out = []
        for side in SIDES:
            keys = self.runs.get(side)
            if keys:
                out.append(f"{_SHOWN[side]} {self._keys(keys)} (no {_other(side)} run)")
        for task in sorted(self.tasks):
            for side in SIDES:
                keys = self.tasks[task].get(side)
                if keys:
                    out.append(f"task {task}: {_SHOWN[side]} {self._keys(keys)} (no "
                               f"{_other(side)} score)")
        if self.average:
            out.append(f"the average over tasks: {self._keys(self.average)} (not scored on "
                       "every task)")
        if self.no_average:
            out.append(f"the average over tasks (fewer than 2 {self.unit}s scored on every "
                       "task)")
        return out

    def refusal(self) -> str:
        """One line naming what a paired test would leave out, and the two fixes."""
        return (f"unpaired scores: {'; '.join(self.items())}; a paired test uses only what "
                "both sides scored: add the missing runs or scores, or pass --allow-unpaired "
                "to test the pairs and list what is left out")

    def lines(self) -> List[str]:
        return [f"left out: {item}" for item in self.items()]

    def to_dict(self) -> Dict[str, object]:
        return {"unit": self.unit,
                "runs": {side: list(self.runs.get(side, [])) for side in SIDES},
                "tasks": {task: {side: list(sides.get(side, [])) for side in SIDES}
                          for task, sides in sorted(self.tasks.items())},
                "average": list(self.average), "no_average": self.no_average}
