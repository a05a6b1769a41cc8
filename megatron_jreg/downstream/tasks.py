"""The paper's downstream tasks by their lm-eval names, and the metric reported per task.

Table 3 of the paper scores each task by accuracy. lm-eval reports ``acc`` for every task
here and also ``acc_norm`` (accuracy with the choices' log-likelihoods divided by their
length in bytes) for arc_easy, hellaswag, piqa, sciq, swag; lambada_openai, boolq, race
and social_iqa have ``acc`` only. ``--metric acc`` (the default) reports ``acc``
everywhere; ``--metric acc_norm`` reports ``acc_norm`` where a task has it and ``acc``
where it does not, and the report names the metric taken for each task. A task with
neither (a local task that defines other metrics) reports its first metric.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from megatron_jreg.errors import InputError
from megatron_jreg.stats.score_scale import ACCURACY_METRICS

PAPER_TASKS = (
    "lambada_openai", "boolq", "arc_easy", "hellaswag", "piqa", "race", "social_iqa",
    "sciq", "swag",
)
# names the paper (and older docs) use for lm-eval's tasks
ALIASES = {"siqa": "social_iqa", "lambada": "lambada_openai", "arc-e": "arc_easy"}
METRICS = ACCURACY_METRICS  # the metrics picked, written in percent


def resolve_tasks(spec: str) -> List[str]:
    """``paper`` or a comma list (``paper`` may appear in it) -> lm-eval task names, in
    order, without repeats."""
    names: List[str] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        for name in PAPER_TASKS if part == "paper" else (ALIASES.get(part, part),):
            if name not in names:
                names.append(name)
    if not names:
        raise InputError(f"--tasks {spec!r}: no task named; give 'paper' or a comma list "
                         "such as boolq,piqa")
    return names


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # lm-eval writes "N/A" for a stderr it did not compute
    return float(value)


def task_metrics(entry: Dict[str, object]) -> Dict[str, float]:
    """lm-eval's per-task result entry ({"acc,none": .., "acc_stderr,none": ..}) -> the
    numeric values by metric name (the ``,none`` filter suffix dropped)."""
    out: Dict[str, float] = {}
    for key, value in entry.items():
        metric, _, filt = key.partition(",")
        number = _number(value)
        if filt in ("none", "") and number is not None and metric != "sample_len":
            out.setdefault(metric, number)
    return out


def pick_metric(
        task: str, metrics: Dict[str, float], wanted: str) -> Tuple[str, float, Optional[float]]:
    """(metric name, value in percent, stderr in percent or None) of one task."""
    order = [wanted] + [m for m in METRICS if m != wanted]
    names = [m for m in order if m in metrics]
    if not names:
        names = [m for m in metrics if not m.endswith("_stderr")]
    if not names:
        raise InputError(f"task {task}: lm-eval reported no metric ({sorted(metrics)})")
    name = names[0]
    stderr = metrics.get(f"{name}_stderr")
    scale = 100.0 if name in METRICS else 1.0  # accuracies in percent, as the paper's table
    value = metrics[name] * scale
    stderr = None if stderr is None or not math.isfinite(stderr) else stderr * scale
    return name, value, stderr
