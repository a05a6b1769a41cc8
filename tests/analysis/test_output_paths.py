"""The analysis tools check every output path before any work.

A missing parent directory is made and the run succeeds; an unwritable one is one line
naming the flag, exit 2, and no model load (no progress bar, no table, no export) first.
"""

import json

import pytest
from checkpoint_runs import REPO, run_env

import forked_trainer
from unwritable import unwritable_dir


def run_tool(script, argv):
    env = dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO)
    return forked_trainer.run_tool(f"tools/{script}", argv, env, timeout=600)


def refused(proc, flag, path):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and f"{flag} {path}" in err[0], err
    return err[0]


def test_eval_jump_outputs(tiny_hf_model, eval_text, tmp_path):
    base = ["--hf-model", tiny_hf_model, "--text-file", eval_text, "--seq-length", "16"]
    new = tmp_path / "new" / "deeper"
    proc = run_tool("eval_jump.py", [*base, "--json", new / "a.json", "--csv", new / "a.csv",
                                     "--plot", tmp_path / "plots" / "a.png"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((new / "a.json").read_text())["num_layers"] == 3
    assert (new / "a.csv").exists() and (tmp_path / "plots" / "a.png").exists()
    bad = unwritable_dir(tmp_path)
    for flag in ("--json", "--csv", "--plot"):
        for path in (f"{bad}/x.out", f"{bad}/missing/x.out"):
            proc = run_tool("eval_jump.py", [*base, flag, path])
            refused(proc, flag, path)
            assert "model:" not in proc.stdout and "tok/s" not in proc.stderr  # nothing measured


def test_convert_to_hf_output(trained_checkpoints, tmp_path):
    out = tmp_path / "exports" / "tiny-hf"
    proc = run_tool("convert_to_hf.py", ["--load", trained_checkpoints["tp1"], "--output", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").exists()
    bad = f"{unwritable_dir(tmp_path)}/missing/tiny-hf"
    refused(run_tool("convert_to_hf.py", ["--load", trained_checkpoints["tp1"], "--output", bad]),
            "--output", bad)


def test_compare_seeds_json(tmp_path):
    scores = tmp_path / "scores.csv"
    scores.write_text("seed,baseline,jreg\n1,1.0,1.5\n2,2.0,2.2\n3,1.0,1.9\n")
    out = tmp_path / "new" / "t.json"
    proc = run_tool("compare_seeds.py", [scores, "--json", out])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())
    bad = f"{unwritable_dir(tmp_path)}/t.json"
    proc = run_tool("compare_seeds.py", [scores, "--json", bad])
    refused(proc, "--json", bad)
    assert proc.stdout == ""  # no table printed first


def test_eval_downstream_outputs_are_checked_before_tasks_load(tiny_hf_model, tmp_path):
    """Before lm-eval loads a task or the model: the report paths and the cache."""
    pytest.importorskip("lm_eval")
    bad = unwritable_dir(tmp_path)
    base = ["--hf-model", tiny_hf_model, "--tasks", "sciq"]
    for flag, path in (("--json", f"{bad}/r.json"), ("--csv", f"{bad}/sub/r.csv"),
                       ("--cache-dir", f"{bad}/cache")):
        proc = run_tool("eval_downstream.py", [*base, flag, path])
        refused(proc, flag, path)
        assert "evaluating" not in proc.stderr
    # a missing parent is made (the run then stops at the uncached hub dataset, offline)
    new = tmp_path / "reports" / "deep"
    proc = run_tool("eval_downstream.py", [*base, "--json", new / "r.json",
                                           "--cache-dir", tmp_path / "c" / "d"])
    assert new.is_dir() and (tmp_path / "c" / "d").is_dir()
    assert proc.returncode == 2 and "HF_DATASETS_OFFLINE" in proc.stderr
