"""Accuracies in percent on both sides: what compare_seeds checks before a t-test.

eval_downstream writes accuracies in percent; lm-eval's own numbers (and a table copied from its
output) are fractions. :func:`check_accuracy` refuses a score outside [0, 100] (6090 typed for
60.90) and :func:`check_scales` a task scored in fractions on one side and in percent on the
other, which a t-test would report as a gain of ~60 points with a p-value near 0.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

from megatron_jreg.errors import InputError

# The mixed scale is told from a real difference by two things at once: one side has every
# score <= 1 and the other a score above 1, and the second side's mean is at least SCALE_RATIO
# times the first's. Fractions against percent give a ratio near 100; a task both sides score
# near 0-1% (baseline 0.6, JREG 1.3) gives a small ratio and is tested as it is. A side
# scoring 0 everywhere reads the same in either scale.
SCALE_RATIO = 10.0
# the metrics eval_downstream writes in percent (downstream/tasks.py scales these by 100)
ACCURACY_METRICS = ("acc", "acc_norm")


def check_accuracy(value: float, where: str) -> None:
    """``value`` is an accuracy in percent; ``where`` names the file, task and seed."""
    if not 0.0 <= value <= 100.0:
        raise InputError(f"{where}: the accuracy {value!r} is outside [0, 100]; accuracies "
                         "are in percent (61.0 for 61%, as eval_downstream writes them): "
                         "fix the value or evaluate that run again")


def _mean(values) -> float:
    return math.fsum(values) / len(values)


def check_scales(scores, tasks: Optional[Iterable[str]] = None) -> None:
    """Refuse a task of ``scores`` ({task: {seed: (baseline, jreg)}}) whose one side looks
    like fractions and the other like percent; only ``tasks`` when given (the accuracies)."""
    wanted = None if tasks is None else set(tasks)
    for task, per_seed in scores.items():
        if (wanted is not None and task not in wanted) or not per_seed:
            continue
        seeds = sorted(per_seed)
        sides = {"baseline": [per_seed[s][0] for s in seeds],
                 "JREG": [per_seed[s][1] for s in seeds]}
        for small, large in (("baseline", "JREG"), ("JREG", "baseline")):
            low, high = sides[small], sides[large]
            if (max(low) <= 1.0 < max(high) and _mean(low) > 0.0
                    and _mean(high) >= SCALE_RATIO * _mean(low)):
                raise InputError(
                    f"task {task}: the {small} scores look like fractions (all <= 1, seed "
                    f"{seeds[0]}: {low[0]:g}) and the {large} scores like percent (seed "
                    f"{seeds[0]}: {high[0]:g}); eval_downstream writes percent: multiply the "
                    f"{small} scores by 100, or give both sides in one scale")
