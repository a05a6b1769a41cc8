"""bench/hf_jreg_step.py at its smallest size (a random Gemma 3 on the CPU, two timed rounds,
with and without gradient checkpointing): its JSON has a row per arm with finite positive
times and ratios, and the LM loss and penalty its arms recorded for their first step are
those of the same model and batch recomputed here with HFJreg (the reference
implementation): the JREG arms did compute the penalty, on the initial weights."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from megatron_jreg.hf_training import HFJreg
from megatron_jreg.ops.displacement import fused_available

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_bench_reports_its_arms_and_the_penalty_it_computed(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    proc = subprocess.run(
        [sys.executable, "bench/hf_jreg_step.py", "--models", "gemma3", "--batch", "2",
         "--seq", "16", "--steps", "2", "--warmup", "0", "--checkpointing", "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"^summary: a JREG step costs .*gemma3 (fused [\d.]+x, )?torch [\d.]+x",
                     proc.stdout, re.M), proc.stdout
    record = json.loads(out.read_text())

    impls = ["fused", "torch"] if fused_available("cpu") else ["torch"]
    want_arms = {("plain" if i is None else f"jreg {i}") + (" + ckpt" if c else "")
                 for c in (False, True) for i in [None] + impls}
    rows = {row["arm"]: row for row in record["rows"]}
    assert set(rows) == want_arms and len(record["rows"]) == len(want_arms)
    for arm, row in rows.items():
        assert row["model"] == "gemma3" and len(row["times_s"]) == 2, arm
        keys = ["median_s", "min_s", "max_s", "ratio", "ratio_min", "ratio_max", "fastest_ratio"]
        if sys.platform.startswith("linux"):  # glibc's mallinfo2: the forward's bytes
            keys.append("fwd_mib")
        for key in keys:
            assert math.isfinite(row[key]) and row[key] > 0, (arm, key, row[key])
        assert all(math.isfinite(t) and t > 0 for t in row["times_s"]), arm
        if row["impl"] is None:
            assert row["ratio"] == 1.0 and row["penalty"] is None, arm

    # the same model (config and seed from the record) and batch, recomputed here
    info = record["models"]["gemma3"]
    assert info["random"] and info["cls"] == "Gemma3ForCausalLM"
    config = transformers.Gemma3TextConfig.from_dict(info["config"])
    torch.manual_seed(info["seed"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    ids = torch.tensor(info["ids"])
    mask = torch.ones_like(ids)
    assert ids.shape == (2, 16)
    jreg = HFJreg(model, lam=record["lam"], alpha=record["alpha"], impl="torch")
    with torch.no_grad():
        lm_loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        want = jreg.penalty(mask)
    assert float(want["penalty"]) > 0
    for arm, row in rows.items():
        assert row["lm_loss"] == pytest.approx(float(lm_loss), rel=1e-5), arm
        if row["impl"] is None:
            continue
        assert row["penalty"] == pytest.approx(float(want["penalty"]), rel=1e-5), arm
        assert row["R"] == pytest.approx(float(want["R"]), rel=1e-5), arm
        torch.testing.assert_close(torch.tensor(row["psi"]), want["psi"], rtol=1e-5, atol=1e-7,
                                   msg=arm)


@pytest.mark.parametrize("flags, message", [
    (["--threads", "-1"], "--threads must be >= 1, got -1"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--warmup", "-5"], "--warmup must be >= 0, got -5"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--json", "/nonexistent_dir_hfbench/x.json"], "no such directory /nonexistent_dir_hfbench"),
    (["--smollm2", "/nonexistent_dir_hfbench"],
     "--smollm2 /nonexistent_dir_hfbench: no such directory"),
])
def test_the_bench_refuses_bad_flags_before_loading_a_model(flags, message):
    # argparse's own error (rc 2, one line, no traceback) before any model is built: the
    # checks come before torch is even imported, so each takes well under a second
    proc = subprocess.run([sys.executable, "bench/hf_jreg_step.py", "--models", "gemma3", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "loading" not in proc.stdout
