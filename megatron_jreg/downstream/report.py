"""One model's downstream scores: the JSON object, the table row, the CSV rows.

Accuracies are in percent (the paper's Table 3); ``average`` is the mean of the reported
task values. The JSON object per model:

    {"model", "source", "iteration", "seed", "tasks": {name: {"metric", "value", "stderr",
     "samples", "lm_eval"}}, "average", "lm_eval_version", "limit", "num_fewshot", "dtype"}
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence


@dataclass
class TaskScore:
    metric: str
    value: float
    stderr: Optional[float]
    samples: Optional[int] = None
    metrics: Dict[str, float] = field(default_factory=dict)
    """every value lm-eval reported for the task, as it reported them (fractions)"""

    def to_dict(self) -> Dict[str, object]:
        return {"metric": self.metric, "value": self.value, "stderr": self.stderr,
                "samples": self.samples, "lm_eval": dict(self.metrics)}


@dataclass
class DownstreamReport:
    model: str
    source: str
    iteration: Optional[int]
    seed: Optional[int]
    lm_eval_version: str
    limit: Optional[float]
    num_fewshot: int
    dtype: str
    tasks: Dict[str, TaskScore] = field(default_factory=dict)

    @property
    def average(self) -> float:
        values = [s.value for s in self.tasks.values()]
        return math.fsum(values) / len(values) if values else math.nan

    def to_dict(self) -> Dict[str, object]:
        return {"model": self.model, "source": self.source, "iteration": self.iteration,
                "seed": self.seed, "tasks": {k: v.to_dict() for k, v in self.tasks.items()},
                "average": self.average, "lm_eval_version": self.lm_eval_version,
                "limit": self.limit, "num_fewshot": self.num_fewshot, "dtype": self.dtype}


def format_table(reports: Sequence[DownstreamReport]) -> str:
    """One row per model, one column per task (its metric under the name), then average."""
    tasks: List[str] = []
    for r in reports:
        tasks += [t for t in r.tasks if t not in tasks]
    first = reports[0]
    metric = {t: next(r.tasks[t].metric for r in reports if t in r.tasks) for t in tasks}
    widths = [max(len(t), len(metric[t]), 7) for t in tasks]
    name_w = max(len("model"), *(len(r.model) for r in reports))
    head = f"{'model':<{name_w}}  " + "  ".join(f"{t:>{w}}" for t, w in zip(tasks, widths))
    sub = f"{'':<{name_w}}  " + "  ".join(f"{metric[t]:>{w}}" for t, w in zip(tasks, widths))
    lines = [head + f"  {'average':>7}", sub]
    for r in reports:
        cells = [f"{r.tasks[t].value:>{w}.2f}" if t in r.tasks else f"{'-':>{w}}"
                 for t, w in zip(tasks, widths)]
        lines.append(f"{r.model:<{name_w}}  " + "  ".join(cells) + f"  {r.average:>7.2f}")
    limit = "" if first.limit is None else f", limit {first.limit:g} per task"
    lines.append(f"accuracy in percent; {first.num_fewshot}-shot{limit}; "
                 f"lm-eval {first.lm_eval_version}")
    return "\n".join(lines)


def to_csv(reports: Sequence[DownstreamReport]) -> str:
    """model,task,metric,value,stderr rows; the average as task ``average``."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["model", "source", "iteration", "task", "metric", "value", "stderr"])
    for r in reports:
        it = "" if r.iteration is None else r.iteration
        for name, s in r.tasks.items():
            writer.writerow([r.model, r.source, it, name, s.metric, repr(s.value),
                             "" if s.stderr is None else repr(s.stderr)])
        writer.writerow([r.model, r.source, it, "average", "", repr(r.average), ""])
    return buf.getvalue()
