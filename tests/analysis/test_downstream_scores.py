"""compare_seeds on eval_downstream's JSON reports: paired by seed, the CSV's numbers.

Accuracies are in percent on both sides (attack 40 #68, #69: the code before reported a
fractions baseline against a percent JREG as "+60.10, t 241.6, p 0.000009", and an
accuracy of 6090 or -5 as a result): a value outside [0, 100] is refused naming the file,
task and seed; a task in fractions on one side and percent on the other is refused naming
the side to multiply by 100; fractions on both sides, a task near 0-1% on both sides and a
local task's own metric (a perplexity, on no fixed scale) are tested as they are.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from megatron_jreg.errors import InputError
from megatron_jreg.stats.downstream_scores import read_report_scores
from megatron_jreg.stats.seed_stats import compare_seed_scores, read_seed_scores

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = {1: (60.1, 70.0), 2: (59.5, 69.1), 3: (60.8, 70.2)}
JREG = {1: (61.0, 70.4), 2: (60.2, 70.0), 3: (60.9, 70.1)}


def report(seed, scores, metric="acc"):
    tasks = {t: {"metric": metric, "value": v, "stderr": 1.0}
             for t, v in zip(("boolq", "piqa"), scores)}
    return {"model": f"s{seed}", "seed": seed, "tasks": tasks, "average": sum(scores) / 2}


def write(path, reports):
    path.write_text(json.dumps(reports))
    return str(path)


def test_reports_pair_by_seed_and_equal_the_long_csv(tmp_path):
    base = write(tmp_path / "b.json", [report(s, BASE[s]) for s in (3, 1, 2)])  # any order
    jreg = [write(tmp_path / f"j{s}.json", report(s, JREG[s])) for s in (2, 3, 1)]
    csv = tmp_path / "long.csv"
    csv.write_text("seed,task,baseline,jreg\n" + "".join(
        f"{s},{t},{BASE[s][i]},{JREG[s][i]}\n" for i, t in enumerate(("boolq", "piqa"))
        for s in (1, 2, 3)))
    got = dict(compare_seed_scores(read_report_scores([base], jreg), backend="exact"))
    want = dict(compare_seed_scores(read_seed_scores(str(csv)), backend="exact"))
    assert set(got) == {"boolq", "piqa", "average"}
    for task in want:
        assert got[task].to_dict() == pytest.approx(want[task].to_dict())
    assert got["average"].mean_difference == pytest.approx(0.4833333333, abs=1e-9)


def test_report_errors(tmp_path):
    ok = write(tmp_path / "ok.json", [report(1, BASE[1]), report(2, BASE[2])])
    with pytest.raises(InputError, match="no such file"):
        read_report_scores([str(tmp_path / "none.json")], [ok])
    bad = write(tmp_path / "bad.json", [{"model": "x"}])
    with pytest.raises(InputError, match="not an eval_downstream report"):
        read_report_scores([bad], [ok])
    twice = write(tmp_path / "twice.json", [report(1, BASE[1]), report(1, BASE[2])])
    with pytest.raises(InputError, match="seed 1 appears twice"):
        read_report_scores([twice], [ok])
    norm = write(tmp_path / "norm.json", [report(1, JREG[1], "acc_norm")])
    with pytest.raises(InputError, match="same --metric"):
        read_report_scores([ok], [norm])
    other = write(tmp_path / "other.json", [report(7, JREG[1])])
    with pytest.raises(InputError, match="no seed is on both sides"):
        read_report_scores([ok], [other])


def _sides(tmp_path, base, jreg, metric="acc"):
    """Three seeds a side: ``base``/``jreg`` map seed -> (boolq, piqa)."""
    return ([write(tmp_path / f"b{s}.json", report(s, base[s], metric)) for s in (1, 2, 3)],
            [write(tmp_path / f"j{s}.json", report(s, jreg[s], metric)) for s in (1, 2, 3)])


def _fractions(scores):
    return {s: tuple(v / 100 for v in pair) for s, pair in scores.items()}


def test_fractions_against_percent_are_refused(tmp_path):
    frac_base, pct_jreg = _sides(tmp_path, _fractions(BASE), JREG)
    with pytest.raises(InputError, match=r"^task boolq: the baseline scores look like fractions "
                       r"\(all <= 1, seed 1: 0\.601\) and the JREG scores like percent \(seed 1: "
                       r"61\); eval_downstream writes percent: "
                       r"multiply the baseline scores by 100"):
        read_report_scores(frac_base, pct_jreg)
    pct_base, frac_jreg = _sides(tmp_path, BASE, _fractions(JREG))
    with pytest.raises(InputError, match="the JREG scores look like fractions"):
        read_report_scores(pct_base, frac_jreg)
    proc = subprocess.run([sys.executable, "tools/compare_seeds.py", "--baseline", *frac_base,
                           "--jreg", *pct_jreg], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and "look like fractions" in proc.stderr


def test_one_scale_on_both_sides_is_tested_as_it_is(tmp_path):
    both = read_report_scores(*_sides(tmp_path, _fractions(BASE), _fractions(JREG)))
    got = dict(compare_seed_scores(both, backend="exact"))
    assert got["boolq"].mean_difference == pytest.approx(0.017 / 3, abs=1e-12)
    # a task near 0-1%: the baseline <= 1 everywhere, JREG above 1, in percent both
    tiny = {1: (0.6, 0.9), 2: (0.8, 1.0), 3: (0.9, 0.7)}
    better = {1: (1.3, 1.2), 2: (1.1, 0.8), 3: (1.4, 1.1)}
    got = dict(compare_seed_scores(read_report_scores(*_sides(tmp_path, tiny, better)),
                                   backend="exact"))
    assert got["boolq"].mean_difference == pytest.approx(0.5, abs=1e-12)
    # JREG at 0 everywhere reads the same in fractions and percent
    zero = {s: (0.0, 0.0) for s in (1, 2, 3)}
    assert read_report_scores(*_sides(tmp_path, BASE, zero))["boolq"]["1"] == (60.1, 0.0)
    # a local task's own metric is no accuracy: neither [0, 100] nor the scale applies
    ppl_base = {1: (250.0, 0.9), 2: (260.0, 0.8), 3: (255.0, 0.7)}
    ppl_jreg = {1: (0.5, 240.0), 2: (0.6, 230.0), 3: (0.7, 250.0)}
    scores = read_report_scores(*_sides(tmp_path, ppl_base, ppl_jreg, "perplexity"))
    assert scores["boolq"]["2"] == (260.0, 0.6)


@pytest.mark.parametrize("value", [6090.0, -5.0, 100.5])
def test_an_accuracy_outside_0_100_is_refused(tmp_path, value):
    base, jreg = _sides(tmp_path, BASE, {**JREG, 3: (value, 70.1)})
    with pytest.raises(InputError) as err:
        read_report_scores(base, jreg)
    assert str(err.value).startswith(f"--jreg {jreg[2]}: task boolq, seed 3: the accuracy "
                                     f"{value!r} is outside [0, 100]; accuracies are in percent")
    for edge in (0.0, 100.0):  # the bounds are accuracies
        base, jreg = _sides(tmp_path, BASE, {**JREG, 3: (edge, 70.1)})
        assert read_report_scores(base, jreg)["boolq"]["3"] == (60.8, edge)


def test_tool_usage_errors_are_one_line(tmp_path):
    ok = write(tmp_path / "ok.json", [report(1, BASE[1])])
    for argv, expected in (([], "no scores"), (["x.csv", "--baseline", ok], "not both"),
                           (["--baseline", ok], "go together")):
        proc = subprocess.run([sys.executable, "tools/compare_seeds.py", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and expected in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_documented_metrics_are_lm_evals_own_for_the_paper_tasks():
    """docs/evaluation.md's --metric row names the paper tasks that report acc_norm; lm-eval's
    own task configs (installed, no download) must say the same, and every paper task must
    report acc, the default metric of Table 3."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from megatron_jreg.downstream.tasks import PAPER_TASKS, pick_metric

    docs = open(os.path.join(REPO, "docs", "evaluation.md"), encoding="utf-8").read()
    row = re.search(r"^\| `--metric acc` \|.*where a task reports it \(([^)]*)\)", docs, re.M)
    assert row, "the --metric row of docs/evaluation.md changed"
    documented = {name.strip() for name in row.group(1).split(",")}
    index = TaskManager().task_index
    with_norm = set()
    for task in PAPER_TASKS:
        metrics = [m["metric"] for m in index[task].cfg["metric_list"]]
        assert "acc" in metrics, (task, metrics)
        if "acc_norm" in metrics:
            with_norm.add(task)
        # what the report takes for each --metric, on lm-eval's metric names
        values = {m: 0.25 + 0.5 * (m == "acc_norm") for m in metrics if m != "perplexity"}
        assert pick_metric(task, values, "acc")[:2] == ("acc", 25.0)
        assert pick_metric(task, values, "acc_norm")[:2] == (
            ("acc_norm", 75.0) if "acc_norm" in metrics else ("acc", 25.0))
    assert with_norm == documented


def test_task_digest_is_the_same_in_every_process():
    """lm-eval leaves functions inside fewshot_config as objects (hellaswag, race): the cache
    key must not hold their memory address, or a re-run never finds its results."""
    code = ("import json, sys\n"
            "from lm_eval.tasks.hellaswag import utils\n"
            "from megatron_jreg.downstream.harness import _digest\n"
            "class Task:\n"
            "    def dump_config(self):\n"
            "        return {'fewshot_config': {'process_docs': utils.process_docs}}\n"
            "print(_digest({'hellaswag': Task()}))\n")
    pytest.importorskip("lm_eval")
    digests = set()
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        digests.add(proc.stdout.strip())
    assert len(digests) == 1
