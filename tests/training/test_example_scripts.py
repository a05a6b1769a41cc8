"""examples/demo.sh, examples/sft_tiny.sh and examples/jreg_across_families.sh run as written.

demo.sh runs once as the README gives it (its own 300 steps per run, into a fresh OUT):
pytest's slowest-tests list shows its time. sft_tiny.sh runs demo.sh first on an OUT that
holds only the demo's data (baseline and JREG pretraining at a small step count, eval_jump),
then fine-tunes both checkpoints and measures them again; a second run of the same command
resumes everything and trains nothing.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from trainer_runs import REPO, read_metrics, run_env

ITERS = 21  # steps of each across-families run (the script warms up for 20)
EVAL_TOKENS = 8192  # tokens eval_jump reads per model there


def prepared_files(data_dir):
    """{name: mtime} of the files of a demo data directory (not the trainers' index cache)."""
    return {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)
            if os.path.isfile(os.path.join(data_dir, f))}


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`bash examples/demo.sh` with its defaults into a fresh OUT: (OUT, the process)."""
    out = tmp_path_factory.mktemp("readme_demo") / "demo"
    proc = subprocess.run(["bash", "examples/demo.sh"], cwd=REPO, env=dict(run_env(), OUT=str(out)),
                          capture_output=True, text=True, timeout=1500)
    return out, proc


def test_demo_as_the_readme_gives_it(demo_run):
    """The README's first command after its install: 300 steps of the tiny preset without
    and with JREG on the same seed and data. Both learn; the baseline develops a small
    final-layer jump (Psi_4 > Psi_3) that JREG lowers, in training and on held-out text."""
    out, proc = demo_run
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("done in ")
    runs = {lam: read_metrics(out / f"tiny_lambda{lam}" / "metrics.jsonl") for lam in ("0", "1.0")}
    for lam, rows in runs.items():
        assert rows[-1]["iteration"] == 300, lam
        assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 1.0, f"lambda {lam}: loss did not fall"
        runs[lam] = rows[-1]
    base, jreg = runs["0"], runs["1.0"]
    assert base["jreg_penalty"] == 0.0 and jreg["jreg_penalty"] > 0.0
    assert base["zeta_L"] > 0.0, "the baseline shows no final-layer jump to suppress"
    assert jreg["zeta_L"] < base["zeta_L"], (jreg["zeta_L"], base["zeta_L"])
    assert jreg["psi"][-1] < 0.7 * base["psi"][-1], (jreg["psi"], base["psi"])
    report = {r["model"]: r for r in json.loads((out / "jump.json").read_text())}
    assert set(report) == {"baseline", "jreg"}
    assert report["jreg"]["jump_rate"]["L"] < report["baseline"]["jump_rate"]["L"]
    assert (out / "jump.csv").stat().st_size > 0 and (out / "jump.png").stat().st_size > 0


def run_script(out, **env):
    full = dict(run_env(), OUT=str(out), TRAIN_ITERS="30", SFT_ITERS="8", **env)
    return subprocess.run(["bash", "examples/sft_tiny.sh"], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=1500)


def test_sft_tiny_runs_the_demo_then_sft_and_prints_the_jump_after_it(demo_run, tmp_path):
    out = tmp_path / "demo"
    shutil.copytree(demo_run[0] / "data", out / "data")  # the demo's data, no checkpoints
    proc = run_script(out)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    # the demo ran as written: its four steps and its jump report
    for step in ("== 1/4", "== 2/4 baseline", "== 3/4 JREG", "== 4/4 eval_jump"):
        assert step in log
    assert json.loads((out / "jump.json").read_text())
    # both fine-tuning runs started from their pretrained checkpoints, at iteration 0
    for lam in ("0", "1.0"):
        assert f"fine-tuning from --pretrained-checkpoint {out}/tiny_lambda{lam}/checkpoints" in log
        rows = [json.loads(line) for line in open(out / f"sft_from_lambda{lam}" / "metrics.jsonl")]
        assert [r["iteration"] for r in rows if "lm_loss" in r][-1] == 8
    assert "% of the train split's token positions are padding" in log
    report = json.loads((out / "sft_jump.json").read_text())
    assert [r["model"] for r in report] == ["baseline-sft", "jreg-sft"]
    for r in report:
        assert r["num_layers"] == 4 and len(r["displacement"]) == 4
        assert set(r["jump_rate"]) == {"L", "L-1", "L-2"}
    # the Table 7 layout at the end: one row per model, zeta_L, zeta_L-1, zeta_L-2
    lines = proc.stdout[proc.stdout.index("== 3/3"):].splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["model", "zeta_L"]))
    assert lines[header].split() == ["model", "zeta_L", "zeta_L-1", "zeta_L-2"]
    for line, r in zip(lines[header + 1:header + 3], report):
        name, *values = line.split()
        assert name == r["model"]
        assert [float(v) for v in values] == [round(r["jump_rate"][k], 4)
                                              for k in ("L", "L-1", "L-2")]

    again = run_script(out)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-5000:]
    assert "running examples/demo.sh first" not in log and "fine-tuning from" not in log
    assert log.count("loaded checkpoint") == 2  # each SFT run resumed at its end
    assert json.loads((out / "sft_jump.json").read_text()) == report


def test_jreg_across_families_trains_each_family_and_reports_zeta(tmp_path, demo_sp_data):
    """examples/jreg_across_families.sh as written: the tiny size of every family, without
    and with JREG, measured by eval_jump; each checkpoint holds its family's model. DATA_DIR
    is the demo data the fixture built with prepare_demo_data.sh's commands (the script
    finds it complete and builds nothing)."""
    out, data_dir = tmp_path / "families", os.path.dirname(demo_sp_data[0])
    env = dict(run_env(), OUT=str(out), DATA_DIR=data_dir, TRAIN_ITERS=str(ITERS),
               EVAL_TOKENS=str(EVAL_TOKENS))
    built = prepared_files(data_dir)
    proc = subprocess.run(["bash", "examples/jreg_across_families.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert prepared_files(data_dir) == built  # prepare_demo_data.sh found it complete
    names = [f"{f}-{v}" for f in ("llama", "gpt2", "qwen3", "mixtral") for v in ("baseline", "jreg")]
    report = json.loads((out / "jump.json").read_text())
    assert [r["model"] for r in report] == names
    for r in report:
        assert r["num_layers"] == 4 and len(r["displacement"]) == 4
        assert set(r["jump_rate"]) == {"L", "L-1", "L-2"}
    for name in names:
        family = name.split("-")[0]
        config = (out / name / "checkpoints" / f"iter_{ITERS:07d}" / "run_config.yaml").read_text()
        preset = "tiny" if family == "llama" else f"{family}-tiny"
        assert f"model_preset: {preset}" in config, name
        rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        lam = [r["jreg_penalty"] for r in rows if "jreg_penalty" in r]
        # lambda 0 measures without a penalty; lambda 1 pays one
        assert (max(lam) == 0.0) == name.endswith("baseline"), name
    # the summary table eval_jump prints: one row per model, zeta_L, zeta_L-1, zeta_L-2
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["model", "zeta_L"]))
    assert [line.split()[0] for line in lines[header + 1:header + 9]] == names
    # each family's JREG checkpoint exports to its Hugging Face class, and eval_jump on the
    # export measures what it measured on the checkpoint
    classes = {"llama": "LlamaForCausalLM", "gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM",
               "mixtral": "MixtralForCausalLM"}
    by_name = {r["model"]: r for r in report}
    for family, hf_class in classes.items():
        name, hf_dir = f"{family}-jreg", tmp_path / f"hf-{family}"
        for argv in (["tools/convert_to_hf.py", "--load", str(out / name / "checkpoints"),
                      "--output", str(hf_dir)],
                     ["tools/eval_jump.py", "--hf-model", str(hf_dir), "--label", name,
                      "--data-path", demo_sp_data[0],
                      "--seq-length", "128", "--max-tokens", str(EVAL_TOKENS), "--batch-size", "16",
                      "--json", str(tmp_path / f"{family}.json")]):
            step = subprocess.run([sys.executable] + argv, cwd=REPO, env=run_env(),
                                  capture_output=True, text=True, timeout=600)
            assert step.returncode == 0, step.stderr[-3000:]
        assert json.loads((hf_dir / "config.json").read_text())["architectures"] == [hf_class]
        hf = json.loads((tmp_path / f"{family}.json").read_text())  # one model: one object
        assert hf["tokens"] == by_name[name]["tokens"]
        for a, b in zip(hf["displacement"], by_name[name]["displacement"]):
            assert abs(a - b) <= 1e-4 * abs(b) + 1e-7, (family, hf["displacement"],
                                                         by_name[name]["displacement"])
