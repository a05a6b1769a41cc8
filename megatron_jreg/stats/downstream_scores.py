"""Per-seed scores from ``tools/eval_downstream.py`` reports, for the seed t-test.

Each file holds one report object or a list of them (``--json`` of eval_downstream).
Reports pair by their ``seed`` (the run config's training seed for ``--load``); when a
report has none (an ``--hf-model``), the reports of each side pair in the order given.
A task pairs the seeds that both sides scored; the average over tasks is left to
``compare_seed_scores`` (the per-seed mean over the tasks, as in the paper). What has no
partner (a seed of one side only, a task one side of a seed lacks) is recorded in the
scores' ``left_out`` (``stats.pairing``), never dropped without a word.
"""

from __future__ import annotations

import json
import math
from typing import Dict, List, Sequence

from megatron_jreg.errors import InputError
from megatron_jreg.stats.pairing import LeftOut, ordered
from megatron_jreg.stats.score_scale import ACCURACY_METRICS, check_accuracy, check_scales
from megatron_jreg.stats.seed_stats import SeedScores


def _reports(paths: Sequence[str], flag: str) -> List[dict]:
    out: List[dict] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise InputError(f"{flag} {path}: no such file; give eval_downstream's --json "
                             "output") from None
        except (OSError, ValueError) as err:
            raise InputError(f"{flag} {path}: not a JSON report ({err})") from None
        items = data if isinstance(data, list) else [data]
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("tasks"), dict):
                raise InputError(f"{flag} {path}: not an eval_downstream report (no 'tasks'); "
                                 "write it with tools/eval_downstream.py --json")
            _check_scores(item, path, flag)
        out += items
    return out


def _is_accuracy(score) -> bool:
    """eval_downstream scales acc and acc_norm to percent; a local task's own metric (its
    first, e.g. a perplexity) is written as lm-eval gives it, on no fixed scale."""
    return not isinstance(score, dict) or score.get("metric") in ACCURACY_METRICS + (None,)


def _check_scores(report: dict, path: str, flag: str) -> None:
    """Each task's ``value`` must be a finite number: a NaN, an inf or a missing score would
    reach the t-test as a mean that is not a number, reported as an overflow. An accuracy
    must lie in [0, 100] (percent)."""
    seed = report.get("seed")
    who = f"seed {seed}" if seed is not None else f"model {report.get('model')}"
    for task, score in report["tasks"].items():
        value = score.get("value") if isinstance(score, dict) else None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value)):
            shown = "missing" if value is None else repr(value)
            raise InputError(f"{flag} {path}: task {task}, {who}: the score is {shown}, not a "
                             "finite number; evaluate that model and task again with "
                             "eval_downstream (--no-cache) or leave the report out")
        if _is_accuracy(score):
            check_accuracy(value, f"{flag} {path}: task {task}, {who}")


def _by_seed(reports: List[dict], flag: str, by_order: bool) -> Dict[str, dict]:
    if by_order:
        return {str(i + 1): r for i, r in enumerate(reports)}  # order given
    out: Dict[str, dict] = {}
    for r in reports:
        seed = str(r["seed"])
        if seed in out:
            raise InputError(f"{flag}: seed {seed} appears twice ({out[seed].get('model')} and "
                             f"{r.get('model')}); give one report per seed")
        out[seed] = r
    return out


def read_report_scores(baseline: Sequence[str], jreg: Sequence[str]):
    """SeedScores ({task: {seed: (baseline, jreg)}}) from the two sides' report files, with
    the seeds and tasks of one side only in its ``left_out``."""
    base_reports, jreg_reports = _reports(baseline, "--baseline"), _reports(jreg, "--jreg")
    # one rule for both sides: a seed of one side never pairs with a position of the other
    by_order = any(r.get("seed") is None for r in base_reports + jreg_reports)
    base = _by_seed(base_reports, "--baseline", by_order)
    ours = _by_seed(jreg_reports, "--jreg", by_order)
    seeds = sorted(set(base) & set(ours))
    if not seeds:
        raise InputError(f"no seed is on both sides (baseline {sorted(base)}, jreg "
                         f"{sorted(ours)}); pair the runs by their training seed")
    scores = SeedScores()
    left = scores.left_out = LeftOut(unit="report" if by_order else "seed")
    left.runs = {"baseline": ordered(set(base) - set(ours)),
                 "jreg": ordered(set(ours) - set(base))}
    for seed in ordered(seeds):
        b, j = base[seed]["tasks"], ours[seed]["tasks"]
        for side, mine, theirs in (("baseline", b, j), ("jreg", j, b)):
            for task in [t for t in mine if t not in theirs]:
                left.tasks.setdefault(task, {}).setdefault(side, []).append(seed)
        for task in [t for t in b if t in j]:
            if b[task].get("metric") != j[task].get("metric"):
                raise InputError(f"task {task}, seed {seed}: baseline reports "
                                 f"{b[task].get('metric')} but jreg {j[task].get('metric')}; "
                                 "evaluate both with the same --metric")
            scores.setdefault(task, {})[seed] = (float(b[task]["value"]), float(j[task]["value"]))
    if not scores:
        raise InputError("the baseline and jreg reports share no task; evaluate the same --tasks")
    accuracies = {t for seed in seeds for t, s in base[seed]["tasks"].items() if _is_accuracy(s)}
    check_scales(scores, accuracies)
    return scores
