"""compare_seeds never drops a score without saying so.

What the tests prove (the code before tested the smaller set with exit 0 and no word):
- report seeds that differ between the sides (baseline 1-4, JREG 1-3 and 5) are refused
  in one line naming the unpaired seeds of each side; with --allow-unpaired each task's
  result is scipy.stats.ttest_rel on the paired seeds 1-3, computed here on its own, and
  stdout and the JSON name seeds 4 and 5 as left out;
- a task one side of a seed lacks is refused naming the task, side and seed; with the flag
  that task pairs the other seeds and the average over tasks leaves the seed out, both
  equal to ttest_rel on those seeds, and the output names both;
- a long CSV whose seed misses a task: the average (the per-seed mean over tasks) is
  refused; with the flag it is ttest_rel of the per-seed means of the seeds with every
  task; when fewer than two seeds have every task, the missing average row is named
  (the code before left the row out);
- reports without a seed pair in the order given, on both sides when one side has no
  seeds (the code before keyed the other side by seed); a third report on one side is named;
- the library's compare_seed_scores refuses by default too.
"""

import json

import pytest

from megatron_jreg.commands.compare_seeds import main
from megatron_jreg.errors import InputError
from megatron_jreg.stats.downstream_scores import read_report_scores
from megatron_jreg.stats.seed_stats import compare_seed_scores, read_seed_scores

stats = pytest.importorskip("scipy.stats")

BASE = {1: (60.1, 70.0), 2: (59.5, 69.1), 3: (60.8, 70.2), 4: (60.0, 70.0)}
JREG = {1: (61.0, 70.4), 2: (60.2, 70.0), 3: (60.9, 70.1), 5: (62.0, 71.0)}
TASKS = ("boolq", "piqa")


def report(seed, scores, tasks=TASKS):
    return {"model": f"s{seed}", "seed": seed,
            "tasks": {t: {"metric": "acc", "value": v, "stderr": 1.0}
                      for t, v in zip(tasks, scores)}}


def write(path, reports):
    path.write_text(json.dumps(reports))
    return str(path)


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, *argv) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == "", (out, err)
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("compare_seeds: error: ") and "--allow-unpaired" in err, err
    return err


def ttest_rel(base, jreg):
    """scipy's paired one-sided test of mean(jreg - base) > 0."""
    result = stats.ttest_rel(jreg, base, alternative="greater")
    return float(result.statistic), float(result.pvalue)


def assert_result(got, base, jreg):
    t, p = ttest_rel(base, jreg)
    assert got["n"] == len(base)
    assert got["t"] == pytest.approx(t, rel=1e-9) and got["p_value"] == pytest.approx(p, rel=1e-9)


def test_unpaired_report_seeds_are_refused_then_named(tmp_path, capsys):
    base = write(tmp_path / "b.json", [report(s, BASE[s]) for s in (1, 2, 3, 4)])
    jreg = write(tmp_path / "j.json", [report(s, JREG[s]) for s in (1, 2, 3, 5)])
    err = refused(capsys, "--baseline", base, "--jreg", jreg)
    assert "baseline seed 4 (no JREG run); JREG seed 5 (no baseline run)" in err, err

    out_json = tmp_path / "r.json"
    rc, out, err = run(capsys, "--baseline", base, "--jreg", jreg, "--allow-unpaired",
                       "--json", out_json)
    assert rc == 0 and err == "", err
    assert out.splitlines()[-2:] == ["left out: baseline seed 4 (no JREG run)",
                                     "left out: JREG seed 5 (no baseline run)"]
    results = json.loads(out_json.read_text())
    paired = (1, 2, 3)
    for i, task in enumerate(TASKS):
        assert_result(results[task], [BASE[s][i] for s in paired], [JREG[s][i] for s in paired])
    assert_result(results["average"], [sum(BASE[s]) / 2 for s in paired],
                  [sum(JREG[s]) / 2 for s in paired])
    assert results["left_out"]["runs"] == {"baseline": ["4"], "jreg": ["5"]}
    assert results["left_out"]["tasks"] == {} and results["left_out"]["average"] == []


def test_a_task_one_side_lacks_is_refused_then_named(tmp_path, capsys):
    seeds = (1, 2, 3, 4)
    jreg_scores = {**JREG, 4: (60.9, 70.3)}
    base = write(tmp_path / "b.json", [report(s, BASE[s]) for s in seeds])
    jreg = write(tmp_path / "j.json", [report(s, jreg_scores[s]) if s != 3
                                        else report(3, jreg_scores[3][:1], ("boolq",))
                                        for s in seeds])
    err = refused(capsys, "--baseline", base, "--jreg", jreg)
    assert ("task piqa: baseline seed 3 (no JREG score); the average over tasks: seed 3 "
            "(not scored on every task)") in err, err

    out_json = tmp_path / "r.json"
    rc, out, _ = run(capsys, "--baseline", base, "--jreg", jreg, "--allow-unpaired",
                     "--json", out_json)
    assert rc == 0
    assert out.splitlines()[-2:] == [
        "left out: task piqa: baseline seed 3 (no JREG score)",
        "left out: the average over tasks: seed 3 (not scored on every task)"]
    results = json.loads(out_json.read_text())
    assert_result(results["boolq"], [BASE[s][0] for s in seeds],
                  [jreg_scores[s][0] for s in seeds])
    whole = (1, 2, 4)
    assert_result(results["piqa"], [BASE[s][1] for s in whole], [jreg_scores[s][1] for s in whole])
    assert_result(results["average"], [sum(BASE[s]) / 2 for s in whole],
                  [sum(jreg_scores[s]) / 2 for s in whole])
    assert results["left_out"]["tasks"] == {"piqa": {"baseline": ["3"], "jreg": []}}
    assert results["left_out"]["average"] == ["3"]


def test_csv_seed_missing_a_task_is_refused_for_the_average(tmp_path, capsys):
    path = tmp_path / "long.csv"
    rows = [(s, "boolq", BASE[s][0], JREG[s][0]) for s in (1, 2, 3)]
    rows += [(s, "piqa", BASE[s][1], JREG[s][1]) for s in (1, 2)]
    path.write_text("seed,task,baseline,jreg\n" + "".join(",".join(map(str, r)) + "\n"
                                                          for r in rows))
    err = refused(capsys, path)
    assert "the average over tasks: seed 3 (not scored on every task)" in err, err
    out_json = tmp_path / "r.json"
    rc, out, _ = run(capsys, path, "--allow-unpaired", "--json", out_json)
    assert rc == 0 and out.splitlines()[-1] == (
        "left out: the average over tasks: seed 3 (not scored on every task)")
    results = json.loads(out_json.read_text())
    assert results["boolq"]["n"] == 3 and results["piqa"]["n"] == 2
    assert_result(results["average"], [sum(BASE[s]) / 2 for s in (1, 2)],
                  [sum(JREG[s]) / 2 for s in (1, 2)])

    # one seed with every task: no average at all, and the output says so
    path.write_text("seed,task,baseline,jreg\n1,boolq,60,61\n2,boolq,59,61\n3,boolq,58,60\n"
                    "1,piqa,70,71\n4,piqa,69,71\n5,piqa,68,69\n")
    scores = read_seed_scores(str(path))
    with pytest.raises(InputError, match="fewer than 2 seeds scored on every task"):
        compare_seed_scores(scores)  # the library refuses by default too
    rc, out, _ = run(capsys, path, "--allow-unpaired")
    assert rc == 0 and not [line for line in out.splitlines() if line.startswith("average")]
    assert out.splitlines()[-1] == (
        "left out: the average over tasks (fewer than 2 seeds scored on every task)")


def test_reports_paired_by_order_name_the_extra_report(tmp_path, capsys):
    def unseeded(scores):
        return dict(report(0, scores), seed=None)

    base = write(tmp_path / "b.json", [unseeded(BASE[s]) for s in (1, 2, 3)])
    jreg = write(tmp_path / "j.json", [unseeded(JREG[s]) for s in (1, 2)] + [unseeded(JREG[3])])
    rc, _, _ = run(capsys, "--baseline", base, "--jreg", jreg)
    assert rc == 0  # as many reports on each side: paired in order, nothing left out
    jreg = write(tmp_path / "j2.json", [unseeded(JREG[s]) for s in (1, 2)])
    err = refused(capsys, "--baseline", base, "--jreg", jreg)
    assert "baseline report 3 (no JREG run)" in err, err
    scores = read_report_scores([base], [jreg])
    assert [task for task, _ in compare_seed_scores(scores, allow_unpaired=True)] == [
        "boolq", "piqa", "average"]


def test_one_side_without_seeds_pairs_both_sides_in_order(tmp_path, capsys):
    """Was: the baseline keyed by seed and the JREG side by position, so baseline seed 1
    met the first JREG report whatever its run."""
    order = (3, 1, 2)
    base = write(tmp_path / "b.json", [report(s, BASE[s]) for s in order])
    jreg = write(tmp_path / "j.json", [dict(report(s, JREG[s]), seed=None) for s in order])
    out_json = tmp_path / "r.json"
    rc, _, _ = run(capsys, "--baseline", base, "--jreg", jreg, "--json", out_json)
    assert rc == 0
    results = json.loads(out_json.read_text())
    for i, task in enumerate(TASKS):
        assert_result(results[task], [BASE[s][i] for s in order], [JREG[s][i] for s in order])
