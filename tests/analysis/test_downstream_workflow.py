"""The documented Table 3 / App. G workflow, run exactly as written, offline.

The three commands of README.md (seeds 1-2) and of docs/evaluation.md (seeds 1-3) are read
from those files and run, ``python`` being this interpreter (forked from a process that has
imported the trainer, tests/forked_trainer.py), in a directory with ``tools`` and
``runs/{baseline,jreg}-s{1,2,3}/ckpt`` (six real tiny training runs).
``--tasks paper`` reads small generated stand-ins of the nine hub datasets from a
pre-populated datasets cache (hub_cache.py), as the docs tell air-gapped users to do.

Checked, against references independent of the tools:
- the reports hold every paper task with ``acc``, the number of documents written, and
  the mean of the nine values as the average; the stdout table shows the same numbers;
- the README's runs come from the tool's result cache (docs' runs first), with equal values;
- one checkpoint's values equal ``lm_eval.simple_evaluate`` on its tools/convert_to_hf.py
  export, and lm-eval's own task configs name the datasets, configs and splits written;
- compare_seeds prints n, mean difference, t, df, p and the lower bound of our own
  paired one-sided t-test on the two reports (scipy's t distribution), to its precision.
"""

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from checkpoint_runs import REPO, make_dataset, run_env, train
from hub_cache import TASKS, populate_paper_datasets

import forked_trainer

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

PAPER = list(TASKS)  # the order of --tasks paper
ACC_NORM = {"arc_easy", "hellaswag", "piqa", "sciq", "swag"}  # the docs' table
DOCS = 8  # rows per split written to the cache
ITERS = 2
LAMBDA = {"baseline": 0.0, "jreg": 1.0}
SEEDS = (1, 2, 3)
REFERENCE = "jreg-s1"  # the run checked against lm-eval's own API
README_MARK = "# Table 3 and App. G:"
DOCS_SECTION = "## Downstream tasks: `tools/eval_downstream.py` (Table 3)"


# ---- the documented commands ------------------------------------------------------------


def _block_lines(lines, start):
    """The lines of a fenced code block from ``start`` up to its closing fence."""
    out = []
    for line in lines[start:]:
        if line.startswith("```"):
            return out
        out.append(line)
    raise AssertionError(f"code block from line {start + 1} is never closed")


def _commands(block):
    """Join ``\\`` continuations, drop comments and blank lines, split with shlex."""
    text = "\n".join(block).replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def readme_commands():
    lines = Path(REPO, "README.md").read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(README_MARK)]
    assert len(starts) == 1, f"README.md: expected one line starting {README_MARK!r}"
    return _commands(_block_lines(lines, starts[0]))


def docs_commands():
    lines = Path(REPO, "docs", "evaluation.md").read_text(encoding="utf-8").splitlines()
    assert DOCS_SECTION in lines, f"docs/evaluation.md: no section {DOCS_SECTION!r}"
    start = lines.index(DOCS_SECTION) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    fences = [i for i in range(start, end) if lines[i].strip() == "```bash"]
    assert fences, f"docs/evaluation.md: no ```bash block in {DOCS_SECTION!r}"
    return _commands(_block_lines(lines, fences[0] + 1))


def expected_commands(seeds):
    evals = [["python", "tools/eval_downstream.py", "--load",
              *[f"runs/{arm}-s{s}/ckpt" for s in seeds],
              "--tasks", "paper", "--json", f"{arm}.json"] for arm in LAMBDA]
    return evals + [["python", "tools/compare_seeds.py", "--baseline", "baseline.json",
                     "--jreg", "jreg.json"]]


def check_shape(commands, seeds, where):
    want = expected_commands(seeds)
    got = "\n".join(shlex.join(c) for c in commands)
    assert commands == want, (f"{where}: the Table 3 commands no longer read as the three this "
                              f"test runs.\nfound:\n{got}\nexpected:\n"
                              + "\n".join(shlex.join(c) for c in want))
    return commands


def test_documented_commands_have_the_expected_shape():
    check_shape(readme_commands(), SEEDS[:2], "README.md")
    check_shape(docs_commands(), SEEDS, "docs/evaluation.md")


# ---- fixtures: checkpoints, datasets, the runs ------------------------------------------


def offline_env(root):
    env = run_env()
    for key in ("XDG_CACHE_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(key, None)  # so HF_HOME and HOME decide every cache
    env.update(HF_HOME=str(root / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HOME=str(root / "home"), PYTHONPATH=REPO, OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def run_in(cwd, argv, env, timeout=600):
    """``python *argv`` in ``cwd``: a script (``tools/X.py ...``) forked from a process that
    has imported the trainer (tests/forked_trainer.py), ``-c CODE ...`` in a new one."""
    if argv[0] == "-c":
        proc = subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True,
                              text=True, timeout=timeout)
    else:
        proc = forked_trainer.run_tool(argv[0], argv[1:], env, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0, (f"{shlex.join(map(str, argv))} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory with tools/, six checkpoints under runs/, and the datasets cache."""
    root = tmp_path_factory.mktemp("workflow")
    (root / "home").mkdir()
    os.symlink(os.path.join(REPO, "tools"), root / "tools")
    counts = populate_paper_datasets(str(root / "hf_home"), docs_per_split=DOCS)
    data = make_dataset(str(tmp_path_factory.mktemp("workflow_data")))

    def one(job):
        arm, seed = job
        train(data, str(root / "runs" / f"{arm}-s{seed}" / "ckpt"), seed=seed,
              jreg_lambda=LAMBDA[arm], train_iters=ITERS)

    with ThreadPoolExecutor(2) as pool:  # two trainer processes at a time
        list(pool.map(one, [(arm, s) for arm in LAMBDA for s in SEEDS]))
    return {"root": root, "env": offline_env(root), "counts": counts}


def run_documented(workdir, commands):
    """The three commands in the work directory; their processes and the two reports."""
    out = {"procs": []}
    for argv in commands:
        out["procs"].append(run_in(workdir["root"], argv[1:], workdir["env"]))
    for arm in LAMBDA:
        out[arm] = json.loads((workdir["root"] / f"{arm}.json").read_text())
    return out


@pytest.fixture(scope="module")
def workflow(workdir):
    """docs/evaluation.md's commands first (empty cache), then README.md's."""
    docs = run_documented(workdir, check_shape(docs_commands(), SEEDS, "docs/evaluation.md"))
    readme = run_documented(workdir, check_shape(readme_commands(), SEEDS[:2], "README.md"))
    return {"docs": (docs, SEEDS), "readme": (readme, SEEDS[:2])}


REFERENCE_SCRIPT = r"""
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
export, names, out = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
tm = TaskManager()
cfg = {}
for n in names:
    c = tm.task_index[n].cfg
    splits = [c.get(k) for k in ("training_split", "validation_split", "test_split")]
    cfg[n] = [c["dataset_path"], c.get("dataset_name"), [s for s in splits if s]]
res = simple_evaluate(model="hf", model_args=f"pretrained={export},dtype=float32", tasks=names,
                      batch_size=8, device="cpu", task_manager=tm)
metrics = {n: {k.split(",")[0]: v for k, v in res["results"][n].items()
               if k.endswith(",none") and isinstance(v, float)} for n in names}
docs = {n: res["n-samples"][n]["effective"] for n in names}
json.dump({"cfg": cfg, "metrics": metrics, "docs": docs}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def reference(workdir, tmp_path_factory):
    """lm-eval's own simple_evaluate on convert_to_hf's export of one run."""
    root, env = workdir["root"], workdir["env"]
    tmp = tmp_path_factory.mktemp("reference")
    export, out = str(tmp / "hf"), tmp / "ref.json"
    run_in(root, ["tools/convert_to_hf.py", "--load", f"runs/{REFERENCE}/ckpt", "--output", export],
           env)
    run_in(root, ["-c", REFERENCE_SCRIPT, export, ",".join(PAPER), str(out)], env)
    return json.loads(out.read_text())


# ---- the reports ------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["docs", "readme"])
def test_reports_hold_every_paper_task(workflow, workdir, which):
    runs, seeds = workflow[which]
    for arm in LAMBDA:
        reports = runs[arm]
        assert isinstance(reports, list) and [r["seed"] for r in reports] == list(seeds), arm
        for r, seed in zip(reports, seeds):
            assert r["source"] == f"runs/{arm}-s{seed}/ckpt" and r["iteration"] == ITERS
            assert (r["lm_eval_version"], r["limit"], r["num_fewshot"], r["dtype"]) == (
                "0.4.13", None, 0, "float32")
            assert list(r["tasks"]) == PAPER, (arm, seed, list(r["tasks"]))
            for task, score in r["tasks"].items():
                assert score["metric"] == "acc", (task, score["metric"])
                assert score["samples"] == workdir["counts"][task] == DOCS, (task, score)
                assert 0.0 <= score["value"] <= 100.0
                assert score["value"] == pytest.approx(100 * score["lm_eval"]["acc"], abs=1e-9)
                # acc_norm exactly where the docs say lm-eval reports it
                assert ("acc_norm" in score["lm_eval"]) == (task in ACC_NORM), task
            values = [r["tasks"][t]["value"] for t in PAPER]
            assert r["average"] == pytest.approx(sum(values) / len(values), abs=1e-9)


@pytest.mark.parametrize("which", ["docs", "readme"])
def test_stdout_table_shows_the_reports(workflow, which):
    runs, seeds = workflow[which]
    for proc, arm in zip(runs["procs"], LAMBDA):
        lines = proc.stdout.strip().splitlines()
        assert lines[0].split() == ["model", *PAPER, "average"]
        assert lines[1].split() == ["acc"] * len(PAPER)
        for line, r in zip(lines[2:], runs[arm]):
            cells = line.split()
            assert cells[0] == r["model"]
            want = [r["tasks"][t]["value"] for t in PAPER] + [r["average"]]
            assert [float(c) for c in cells[1:]] == pytest.approx(want, abs=0.005 + 1e-9)
        assert len(lines) == 2 + len(seeds) + 1


def test_readme_reports_equal_the_docs_reports(workflow):
    docs, readme = workflow["docs"][0], workflow["readme"][0]
    for arm in LAMBDA:
        assert readme[arm] == docs[arm][:2], arm


def test_readme_runs_come_from_the_cache(workflow, workdir):
    docs, readme = workflow["docs"][0], workflow["readme"][0]
    for proc in docs["procs"][:2]:  # a fresh cache: every model is evaluated, all tasks
        assert proc.stderr.count(f"evaluating {', '.join(PAPER)}\n") == len(SEEDS)
    for proc in readme["procs"][:2]:  # no task evaluated, so no checkpoint exported
        again = [line for line in proc.stderr.splitlines() if ": evaluating " in line]
        assert not again, f"the cache missed on the README's re-run: {again}"
    cache = workdir["root"] / "home" / ".cache" / "megatron_jreg" / "eval_downstream"
    assert len(list(cache.glob("*.json"))) == len(LAMBDA) * len(SEEDS) * len(PAPER)


def test_hub_cache_is_what_lm_eval_reads(reference, workdir):
    for task, (path, name, splits) in TASKS.items():
        assert reference["cfg"][task] == [path, name, list(splits)], task
    assert reference["docs"] == workdir["counts"]


def test_values_equal_lm_evals_own_api(reference, workflow):
    arm, seed = REFERENCE.split("-s")
    (report,) = [r for r in workflow["docs"][0][arm] if r["seed"] == int(seed)]
    for task in PAPER:
        ref = reference["metrics"][task]
        assert report["tasks"][task]["value"] == pytest.approx(100 * ref["acc"], abs=1e-4), task
        # every other value lm-eval reported too (acc_norm, perplexity, stderrs)
        assert set(report["tasks"][task]["lm_eval"]) == set(ref) - {"sample_len"}, task
        for metric, value in report["tasks"][task]["lm_eval"].items():
            assert value == pytest.approx(ref[metric], rel=1e-4, abs=1e-6), (task, metric)


# ---- compare_seeds ----------------------------------------------------------------------


def t_test(d):
    """Our own one-sided t-test of mean(d) > 0: n, mean, t, df, p, lower bound (95%)."""
    try:
        from scipy import stats
    except ImportError:
        stats = None
    n, mean, sd = len(d), statistics.fmean(d), statistics.stdev(d)
    se = sd / math.sqrt(n)
    if se == 0:  # equal differences: the sign decides (nan when all are 0)
        t = math.copysign(math.inf, mean) if mean else math.nan
        p, lower = (math.nan if mean == 0 else float(mean < 0)), mean
    elif stats is None:
        t, p, lower = mean / se, None, None
    else:
        t = mean / se
        p, lower = float(stats.t.sf(t, n - 1)), mean - float(stats.t.ppf(0.95, n - 1)) * se
    return {"n": n, "mean": mean, "t": t, "df": n - 1, "p": p, "lower": lower}


def expected_rows(base, jreg):
    b = {r["seed"]: r["tasks"] for r in base}
    j = {r["seed"]: r["tasks"] for r in jreg}
    seeds = sorted(set(b) & set(j))
    rows = {task: t_test([j[s][task]["value"] - b[s][task]["value"] for s in seeds])
            for task in PAPER}
    means = {side: [statistics.fmean(x[s][t]["value"] for t in PAPER) for s in seeds]
             for side, x in (("b", b), ("j", j))}
    rows["average"] = t_test([mj - mb for mb, mj in zip(means["b"], means["j"])])
    return rows


def close(printed, value, decimals):
    """``printed`` shows ``value`` to ``decimals`` places (nan and inf as themselves)."""
    x = float(printed)
    if value is None:  # not computed without scipy
        return True
    if math.isnan(value) or math.isinf(value):
        return (math.isnan(x) and math.isnan(value)) or x == value
    return abs(x - value) <= 0.5 * 10 ** -decimals + 1e-9 * max(1.0, abs(value))


@pytest.mark.parametrize("which", ["docs", "readme"])
def test_compare_seeds_matches_our_t_test(workflow, which):
    runs, seeds = workflow[which]
    lines = runs["procs"][2].stdout.strip().splitlines()
    assert lines[0].split() == ["task", "n", "mean", "diff", "t", "df", "p", "(one-sided)",
                                "95%", "lower"]
    assert lines[-1].startswith("diff = jreg - baseline; H1: mean diff > 0; backend: ")
    printed = {cells[0]: cells[1:] for cells in (line.split() for line in lines[1:-1])}
    want = expected_rows(runs["baseline"], runs["jreg"])
    assert list(printed) == [*PAPER, "average"]
    for task, (n, mean, t, df, p, lower) in printed.items():
        w = want[task]
        assert (int(n), int(df)) == (w["n"], w["df"]) == (len(seeds), len(seeds) - 1), task
        for name, text, value, places in (("mean diff", mean, w["mean"], 4), ("t", t, w["t"], 3),
                                          ("p", p, w["p"], 6), ("lower", lower, w["lower"], 4)):
            assert close(text, value, places), (task, name, text, value)
