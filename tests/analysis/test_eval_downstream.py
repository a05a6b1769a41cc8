"""tools/eval_downstream.py on the tiny checkpoints, offline, with two local tasks.

The --load path (checkpoint -> temporary HF export -> lm-eval) and the --hf-model path
(on tools/convert_to_hf.py's export) must agree, and both must equal lm-eval's own
``simple_evaluate`` on the export; the TP2 run must score as its TP1 twin.
"""

import json
import math
import subprocess
import sys

import pytest
from checkpoint_runs import REPO, run_env
from downstream_tasks import CHOICE, LAMBADA, write_tasks

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

TASKS = f"{LAMBADA},{CHOICE}"
BATCH = "4"


def offline_env(hf_home):
    env = run_env()
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(hf_home),
               PYTHONPATH=REPO, TOKENIZERS_PARALLELISM="false")
    return env


def tool(argv, env, check=True):
    proc = subprocess.run([sys.executable, "tools/eval_downstream.py", *map(str, argv)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def close(a, b, tol=1e-4):
    return abs(a - b) <= tol * max(1.0, abs(b))


@pytest.fixture(scope="module")
def runs(trained_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("downstream")
    tasks = write_tasks(str(root / "tasks"))
    env = offline_env(root / "hf_home")
    common = ["--tasks", TASKS, "--include-path", tasks, "--batch-size", BATCH,
              "--cache-dir", root / "cache"]
    out = {"tasks": tasks, "env": env, "common": common, "root": root}
    out["load"] = tool(["--load", trained_checkpoints["tp1"], trained_checkpoints["tp2"],
                        "--label", "tp1", "--label", "tp2", *common,
                        "--json", root / "load.json", "--csv", root / "load.csv"], env)
    export = str(root / "tp2-hf")
    proc = subprocess.run([sys.executable, "tools/convert_to_hf.py", "--load",
                           trained_checkpoints["tp2"], "--output", export],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out["export"] = export
    hf = ["--hf-model", export, "--label", "tp2-hf", "--include-path", tasks,
          "--batch-size", BATCH, "--cache-dir", root / "cache"]
    out["hf_first"] = tool([*hf, "--tasks", LAMBADA], env)
    out["hf"] = tool([*hf, "--tasks", TASKS, "--json", root / "hf.json"], env)
    out["hf_again"] = tool([*hf, "--tasks", TASKS], env)
    out["load_json"] = json.loads((root / "load.json").read_text())
    out["hf_json"] = json.loads((root / "hf.json").read_text())
    return out


def test_load_and_hf_model_paths_agree(runs):
    tp2 = runs["load_json"][1]
    hf = runs["hf_json"]
    assert (tp2["model"], hf["model"]) == ("tp2", "tp2-hf")
    assert tp2["iteration"] == 3 and tp2["seed"] == 1234 and hf["iteration"] is None
    for task in (LAMBADA, CHOICE):
        a, b = tp2["tasks"][task], hf["tasks"][task]
        assert a["samples"] == b["samples"] == 24
        assert set(a["lm_eval"]) == set(b["lm_eval"]) >= {"acc"}
        for metric, value in b["lm_eval"].items():
            assert close(a["lm_eval"][metric], value), (task, metric, a["lm_eval"][metric], value)
    assert close(tp2["average"], hf["average"])


def test_matches_lm_evals_own_api(runs, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ref = simple_evaluate(model="hf", model_args=f"pretrained={runs['export']},dtype=float32",
                          tasks=[LAMBADA, CHOICE], num_fewshot=0, batch_size=int(BATCH),
                          device="cpu", task_manager=TaskManager(include_path=runs["tasks"]))
    hf = runs["hf_json"]
    checked = 0
    for task in (LAMBADA, CHOICE):
        for key, value in ref["results"][task].items():
            metric, _, filt = key.partition(",")
            if filt != "none" or not isinstance(value, float) or metric == "sample_len":
                continue
            got = hf["tasks"][task]["lm_eval"][metric]
            assert close(got, value), (task, metric, got, value)
            checked += 1
        # the table's value: acc in percent (the default --metric)
        assert hf["tasks"][task]["metric"] == "acc"
        assert hf["tasks"][task]["value"] == pytest.approx(100 * ref["results"][task]["acc,none"],
                                                            abs=1e-4)
    assert checked >= 5  # perplexity, acc (+ stderrs), acc_norm
    values = [hf["tasks"][t]["value"] for t in (LAMBADA, CHOICE)]
    assert hf["average"] == pytest.approx(math.fsum(values) / 2, abs=1e-12)
    assert hf["lm_eval_version"] == "0.4.13" and hf["num_fewshot"] == 0 and hf["limit"] is None


def test_tp2_checkpoint_scores_as_its_tp1_twin(runs):
    tp1, tp2 = runs["load_json"]
    for task in (LAMBADA, CHOICE):
        for metric, value in tp1["tasks"][task]["lm_eval"].items():
            assert close(tp2["tasks"][task]["lm_eval"][metric], value), (task, metric)


def test_table_and_csv(runs):
    lines = runs["load"].stdout.strip().splitlines()
    assert lines[0].split() == ["model", LAMBADA, CHOICE, "average"]
    assert lines[1].split() == ["acc", "acc"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:4]}
    tp1 = runs["load_json"][0]
    assert float(rows["tp1"][-1]) == pytest.approx(tp1["average"], abs=0.006)
    csv_lines = (runs["root"] / "load.csv").read_text().splitlines()
    assert csv_lines[0] == "model,source,iteration,task,metric,value,stderr"
    assert len(csv_lines) == 1 + 2 * 3 and csv_lines[3].split(",")[3] == "average"


def test_cache_evaluates_only_the_new_task(runs):
    assert f"evaluating {LAMBADA}\n" in runs["hf_first"].stderr
    assert f"evaluating {CHOICE}\n" in runs["hf"].stderr  # the LAMBADA task came from the cache
    assert "evaluating" not in runs["hf_again"].stderr
    assert runs["hf_again"].stdout == runs["hf"].stdout


def test_compare_seeds_reads_the_reports(runs, tmp_path):
    """tp1 as 'baseline' and tp2 as 'jreg' of two seeds: the differences are ~0."""
    base, jreg = tmp_path / "base.json", tmp_path / "jreg.json"
    reports = runs["load_json"]
    twins = [dict(r, seed=s) for r in reports for s in (1, 2)]
    base.write_text(json.dumps(twins[:2]))
    jreg.write_text(json.dumps(twins[2:]))
    proc = subprocess.run([sys.executable, "tools/compare_seeds.py", "--baseline", base,
                           "--jreg", jreg, "--json", tmp_path / "t.json"], cwd=REPO,
                          env=runs["env"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "t.json").read_text())
    assert set(result) == {LAMBADA, CHOICE, "average"}
    assert result["average"]["n"] == 2
    expected = reports[1]["average"] - reports[0]["average"]
    assert result["average"]["mean_difference"] == pytest.approx(expected, abs=1e-9)


def test_missing_dataset_offline_says_how_to_cache_it(runs):
    proc = tool(["--hf-model", runs["export"], "--tasks", "sciq", "--no-cache"], runs["env"],
                check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "sciq" in err and "HF_DATASETS_OFFLINE" in err and "HF_HOME" in err


@pytest.mark.parametrize("extra, expected", [
    (["--load", "{tp1}", "{tp2}", "--label", "only-one"], "1 --label for 2 models"),
    (["--load", "{tp1}", "--label", "a", "--label", "b"], "2 --label for 1 models"),
    (["--hf-model", "{export}", "--iteration", "3"], "--iteration applies to --load CKPT only"),
    (["--load", "{tp1}", "--iteration", "99"], "99"),
])
def test_model_selection_errors_are_one_line_before_any_work(runs, trained_checkpoints,
                                                            extra, expected):
    paths = dict(tp1=trained_checkpoints["tp1"], tp2=trained_checkpoints["tp2"],
                 export=runs["export"])
    argv = [a.format(**paths) for a in extra]
    proc = tool([*argv, "--tasks", TASKS, "--include-path", runs["tasks"], "--no-cache",
                 "--json", runs["root"] / "never.json"], runs["env"], check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert expected in err, err
    # refused before any task is evaluated or any report written
    assert "evaluating" not in err and not (runs["root"] / "never.json").exists()
