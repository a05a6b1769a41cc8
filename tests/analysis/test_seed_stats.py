"""The one-sided paired t-test: exact Student t against textbook values and scipy."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_jreg.errors import InputError
from megatron_jreg.stats import seed_stats
from megatron_jreg.stats.seed_stats import (
    compare_seed_scores,
    one_sided_t_test,
    paired_one_sided_t_test,
    read_seed_scores,
    regularized_incomplete_beta,
    t_ppf,
    t_ppf_exact,
    t_sf,
    t_sf_exact,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Textbook one-sided critical values t_{q, df} (Student t tables), to the tables' 6 digits.
QUANTILES = [
    (0.95, 4, 2.131847),
    (0.95, 5, 2.015048),
    (0.975, 10, 2.228139),
    (0.99, 1, 31.820516),
    (0.95, 30, 1.697261),
]


def _backends():
    out = ["exact"]
    try:
        import scipy  # noqa: F401

        out.append("scipy")
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("q, df, value", QUANTILES)
def test_textbook_quantiles(backend, q, df, value):
    assert t_ppf(q, df, backend) == pytest.approx(value, abs=1e-6)
    assert t_sf(value, df, backend) == pytest.approx(1 - q, abs=1e-6)


@pytest.mark.parametrize("backend", _backends())
def test_known_tails(backend):
    assert t_sf(2.015048, 5, backend) == pytest.approx(
        0.05, abs=1e-6
    )  # the usual "t = 2.015, df = 5"
    assert t_sf(1.0, 1, backend) == pytest.approx(0.25, abs=1e-12)  # Cauchy: 1/2 - atan(1)/pi
    for t in (-3.0, -0.5, 0.0, 0.7, 4.0):  # df = 2 has a closed form
        assert t_sf(t, 2, backend) == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


def test_exact_matches_scipy_widely():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3, 4.5, 9, 29, 200):
        for t in (-8.0, -2.0, -0.1, 0.0, 0.3, 1.5, 2.5, 6.0, 30.0):
            assert t_sf_exact(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-9, abs=1e-14)
        for q in (0.6, 0.9, 0.95, 0.99, 0.999, 0.05):
            assert t_ppf_exact(q, df) == pytest.approx(stats.t.ppf(q, df), rel=1e-9)
    assert regularized_incomplete_beta(2.0, 3.0, 0.4) == pytest.approx(
        stats.beta.cdf(0.4, 2.0, 3.0), rel=1e-12
    )


@pytest.mark.parametrize("backend", _backends())
def test_one_sided_test_by_hand(backend):
    # d = (0.5, 0.1, 0.6, 0.2): mean 0.35, sd 0.238048, se 0.119024, t = 2.940588, df 3
    r = paired_one_sided_t_test([1, 2, 3, 4], [1.5, 2.1, 3.6, 4.2], backend=backend)
    assert (r.n, r.df) == (4, 3)
    assert r.mean_difference == pytest.approx(0.35)
    assert r.t == pytest.approx(2.940588, abs=1e-6)
    assert r.p_value == pytest.approx(0.0302408, abs=1e-6)
    assert r.lower_bound == pytest.approx(0.35 - 2.353363 * 0.119024, abs=1e-5)
    assert r.backend == backend


def test_agrees_with_scipy_ttest():
    stats = pytest.importorskip("scipy.stats")
    d = [0.8, -0.2, 1.1, 0.4, 0.3]
    r = one_sided_t_test(d, backend="exact")
    ref = stats.ttest_1samp(d, 0.0, alternative="greater")
    assert r.t == pytest.approx(ref.statistic, rel=1e-12)
    assert r.p_value == pytest.approx(ref.pvalue, abs=1e-12)
    assert r.lower_bound == pytest.approx(ref.confidence_interval(0.95).low, abs=1e-12)


def test_edge_cases():
    with pytest.raises(InputError, match="at least 2"):
        one_sided_t_test([0.3])
    same = one_sided_t_test([0.5, 0.5, 0.5])
    assert same.p_value == 0.0 and same.t == math.inf
    with pytest.raises(InputError, match="backend"):
        one_sided_t_test([1, 2], backend="nope")


def test_scipy_backend_missing(monkeypatch):
    monkeypatch.setattr(seed_stats, "_scipy_t", lambda: None)
    assert one_sided_t_test([0.1, 0.3, 0.2]).backend == "exact"
    with pytest.raises(InputError, match=r"-e \"\.\[stats\]\""):
        one_sided_t_test([0.1, 0.3, 0.2], backend="scipy")


LONG = """seed,task,baseline,jreg
1,boolq,60.1,61.0
2,boolq,59.5,60.2
3,boolq,60.8,60.9
1,piqa,70.0,70.4
2,piqa,69.1,70.0
3,piqa,70.2,70.1
"""
WIDE = """seed,boolq_baseline,boolq_jreg,piqa_baseline,piqa_jreg
1,60.1,61.0,70.0,70.4
2,59.5,60.2,69.1,70.0
3,60.8,60.9,70.2,70.1
"""


def test_long_and_wide_csv_agree(tmp_path):
    long_path, wide_path = tmp_path / "long.csv", tmp_path / "wide.csv"
    long_path.write_text(LONG)
    wide_path.write_text(WIDE)
    long, wide = read_seed_scores(str(long_path)), read_seed_scores(str(wide_path))
    assert long == wide
    results = dict(compare_seed_scores(long, backend="exact"))
    assert list(results) == ["boolq", "piqa", "average"]
    assert results["boolq"].mean_difference == pytest.approx((0.9 + 0.7 + 0.1) / 3)
    avg_diffs = [(0.9 + 0.4) / 2, (0.7 + 0.9) / 2, (0.1 - 0.1) / 2]
    assert results["average"].mean_difference == pytest.approx(sum(avg_diffs) / 3)
    assert results["average"].p_value == pytest.approx(
        one_sided_t_test(avg_diffs).p_value, abs=1e-9
    )


def test_csv_errors(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("seed,a,b\n1,2,3\n")
    with pytest.raises(InputError, match="docs/evaluation.md"):
        read_seed_scores(str(bad))
    bad.write_text("seed,baseline,jreg\n1,60,x\n")
    with pytest.raises(InputError, match=r"bad.csv:2: column 'jreg' holds 'x'"):
        read_seed_scores(str(bad))
    bad.write_text("seed,baseline,jreg\n1,60,61\n1,60,62\n")
    with pytest.raises(InputError, match="appears twice"):
        read_seed_scores(str(bad))
    with pytest.raises(InputError, match="no such file"):
        read_seed_scores(str(tmp_path / "missing.csv"))


def run_compare_seeds(*args):
    tool = os.path.join(REPO, "tools", "compare_seeds.py")
    return subprocess.run([sys.executable, tool, *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def _long_rows():
    """{task: [(seed, baseline, jreg)]} of LONG, parsed here, not by the package."""
    rows = {}
    for line in LONG.strip().splitlines()[1:]:
        seed, task, base, jreg = line.split(",")
        rows.setdefault(task, []).append((seed, float(base), float(jreg)))
    return rows


def _independent_test(diffs, confidence):
    """The one-sided t-test of mean(diffs) > 0 with the statistics module and scipy."""
    import statistics

    n = len(diffs)
    mean, sd = statistics.mean(diffs), statistics.stdev(diffs)
    se = sd / math.sqrt(n)
    expected = {"n": n, "df": n - 1, "mean_difference": mean, "std_difference": sd,
                "t": mean / se, "confidence": confidence}
    try:
        from scipy.stats import t as student_t
    except ImportError:  # p and the bound need the t distribution; the rest is checked
        return expected
    expected["p_value"] = float(student_t.sf(mean / se, n - 1))
    expected["lower_bound"] = mean - float(student_t.ppf(confidence, n - 1)) * se
    return expected


def _expected_results(confidence):
    rows = _long_rows()
    expected = {task: _independent_test([j - b for _, b, j in r], confidence)
                for task, r in rows.items()}
    # the per-seed average over tasks, then the same test on its differences
    seeds = sorted({seed for r in rows.values() for seed, _, _ in r})
    by_seed = {task: {seed: (b, j) for seed, b, j in r} for task, r in rows.items()}
    base = [sum(by_seed[t][s][0] for t in rows) / len(rows) for s in seeds]
    jreg = [sum(by_seed[t][s][1] for t in rows) / len(rows) for s in seeds]
    expected["average"] = _independent_test([j - b for b, j in zip(base, jreg)], confidence)
    return expected


@pytest.mark.parametrize("flags, confidence, backend", [
    ([], 0.95, "scipy" if "scipy" in _backends() else "exact"),
    (["--backend", "exact", "--confidence", "0.9"], 0.9, "exact"),
], ids=["default", "exact_90"])
def test_compare_seeds_tool(tmp_path, flags, confidence, backend):
    path = tmp_path / "scores.csv"
    path.write_text(LONG)
    out = tmp_path / "r.json"
    proc = run_compare_seeds(path, "--json", out, *flags)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split()[:3] == ["task", "n", "mean"]
    assert "average" in proc.stdout
    results = json.loads(out.read_text())
    assert list(results) == ["boolq", "piqa", "average"]
    expected = _expected_results(confidence)
    for task, want in expected.items():
        got = results[task]
        assert set(got) == {"n", "mean_difference", "std_difference", "t", "df", "p_value",
                            "lower_bound", "confidence", "backend"}, task
        assert got["backend"] == backend
        assert (got["n"], got["df"]) == (want["n"], want["df"]) == (3, 2), task
        for key in ("mean_difference", "std_difference", "t", "p_value", "lower_bound"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-12), (task, key)
        assert got["confidence"] == confidence
        # the printed row holds the same numbers, rounded as the table prints them
        row = next(line.split() for line in proc.stdout.splitlines() if line.split()[:1] == [task])
        assert row[1:] == [str(got["n"]), f"{got['mean_difference']:+.4f}", f"{got['t']:.3f}",
                           str(got["df"]), f"{got['p_value']:.6f}", f"{got['lower_bound']:+.4f}"]
    if flags:
        return
    proc = run_compare_seeds(tmp_path / "none.csv")
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("compare_seeds: error:")
        and proc.stderr.count("\n") == 1
    )


def _strict(text):
    def reject(name):
        raise ValueError(f"bare {name} is not JSON")

    return json.loads(text, parse_constant=reject)


def test_compare_seeds_json_is_strict_with_null_for_nan(tmp_path):
    """All differences 0: no p-value (NaN) and t = NaN: printed nan, JSON null, never 0."""
    path = tmp_path / "same.csv"
    path.write_text("seed,baseline,jreg\n1,60,60\n2,61,61\n3,59,59\n")
    out = tmp_path / "r.json"
    proc = run_compare_seeds(path, "--json", out)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split()[3:6] == ["nan", "2", "nan"]
    result = _strict(out.read_text())["score"]
    assert result["p_value"] is None and result["t"] is None
    assert result["mean_difference"] == 0.0 and result["n"] == 3


def test_compare_seeds_overflow_and_confidence_are_one_line(tmp_path):
    # a CSV refuses such scores (accuracies lie in [0, 100]); the library still says overflow
    with pytest.raises(InputError, match="the scores are too large"):
        compare_seed_scores({"score": {"1": (-1e308, 1e308), "2": (1e308, -1e308),
                                       "3": (1.0, 2.0)}})
    huge = tmp_path / "huge.csv"
    huge.write_text("seed,baseline,jreg\n1,-1e308,1e308\n2,1e308,-1e308\n3,1,2\n")
    ok = tmp_path / "ok.csv"
    ok.write_text(LONG)
    for argv, expected in (
        ([str(huge)], f"{huge}:2: task score, seed 1, baseline: the accuracy -1e+308 is "
                      "outside [0, 100]"),
        ([str(ok), "--confidence", "2"], "--confidence 2.0: must be in (0, 1)"),
    ):
        proc = run_compare_seeds(*argv)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("compare_seeds: error:") and expected in proc.stderr


def test_csv_accuracies_are_percent_on_both_sides(tmp_path):
    """Attack 40 #68, #69 on the CSV: the code before tested 6090 and fractions against
    percent as results."""
    path = tmp_path / "s.csv"
    path.write_text(LONG.replace("59.5,60.2", "59.5,6020"))
    with pytest.raises(InputError, match=r"s\.csv:3: task boolq, seed 2, jreg: the accuracy "
                       r"6020\.0 is outside \[0, 100\]"):
        read_seed_scores(str(path))
    path.write_text("seed,boolq_baseline,boolq_jreg\n1,0.601,61.0\n2,0.595,60.2\n3,0.608,60.9\n")
    proc = run_compare_seeds(path)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert (f"{path}: task boolq: the baseline scores look like fractions (all <= 1, seed 1: "
            "0.601) and the JREG scores like percent (seed 1: 61)") in proc.stderr
    # one scale on both sides, fractions or a task near 1%, is tested as it is
    path.write_text("seed,baseline,jreg\n1,0.601,0.610\n2,0.595,0.602\n3,0.608,0.609\n")
    assert read_seed_scores(str(path))["score"]["2"] == (0.595, 0.602)
    path.write_text("seed,baseline,jreg\n1,0.6,1.3\n2,0.8,1.1\n3,0.9,1.4\n")
    assert read_seed_scores(str(path))["score"]["3"] == (0.9, 1.4)


def test_compare_seeds_refuses_one_report_on_both_sides(tmp_path):
    """Was: exit 0 with t and p of nan for every task (every difference 0)."""
    report = tmp_path / "run.json"
    report.write_text("{}")
    proc = run_compare_seeds("--baseline", report, "--jreg", report)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr
    assert "is given as both --baseline and --jreg" in err[0]
