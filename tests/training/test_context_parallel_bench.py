"""bench/context_parallel_step.py at toy sizes on the CPU, as a user runs it: CP2's loss and
Psi against the one-process CP1 run of the same weights and batch, the memory it measures
per rank (CP2 saves about half the activations), the table and the summary; bad flags
refused in one line."""

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from trainer_runs import REPO, run_env

SCRIPT = os.path.join("bench", "context_parallel_step.py")
TOY = ["--layers", "1", "--hidden", "128", "--seq", "256", "--vocab", "512", "--steps", "1"]


def _bench_module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass of gpu_checks looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def toy_run():
    proc = subprocess.run([sys.executable, SCRIPT] + TOY, cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    found = re.findall(r"^RESULT (\{.*\})$", proc.stdout, re.M)
    assert len(found) == 1, proc.stdout[-3000:]
    return proc.stdout, json.loads(found[0])


def test_cp2_equals_cp1_and_saves_less_per_rank(toy_run):
    out, result = toy_run
    cp1, cp2 = result["cp1"], result["cp2"]
    assert (cp1["cp"], cp1["ranks"], cp2["cp"], cp2["ranks"]) == (1, 1, 2, 2)
    assert result["dtype"] == "fp32" and result["seq"] == 256 and result["cp2_skipped"] is None
    # the one-process run is the reference: the same weights and batch give the same loss and Psi
    assert len(cp1["psi"]) == len(cp2["psi"]) == 1
    pairs = [(cp1["lm_loss"], cp2["lm_loss"])] + list(zip(cp1["psi"], cp2["psi"]))
    for ref, got in pairs:
        assert math.isfinite(ref) and ref > 0
        assert got == pytest.approx(ref, rel=1e-5, abs=0)
    assert result["check"]["ok"] and result["check"]["max_rel_diff"] <= 1e-5
    # memory per rank: real figures, and CP2 keeps about half of CP1's activations per rank
    for run in (cp1, cp2):
        assert run["saved_bytes_per_rank"] > 0 and run["peak_bytes_per_rank"] > 0
        assert isinstance(run["growth_bytes_per_rank"], int)
        assert run["step_s"] > 0 and run["tokens_per_s"] > 0
    assert cp2["saved_bytes_per_rank"] < 0.75 * cp1["saved_bytes_per_rank"]
    assert result["ratios"]["saved_bytes_per_rank"] == pytest.approx(
        cp2["saved_bytes_per_rank"] / cp1["saved_bytes_per_rank"])
    # the table, the check and the summary as printed
    for line in ("==> CP1: 1 process(es)", "==> CP2: 2 process(es)", "[CP2] step 2 (timed)"):
        assert line in out, line
    for row in ("step time", "tokens/s", "saved activations/rank", "peak RSS/rank",
                "peak RSS growth/rank"):
        assert re.search(rf"^{re.escape(row)} +\| .+ \| .+ \| \d+\.\d\dx$", out, re.M), row
    assert re.search(r"^check: CP2's lm loss and Psi .* max rel diff \S+ \(limit 1e-05\): ok$", out,
                     re.M)
    assert re.search(r"^summary: CP2/CP1 step time \d+\.\d\dx, saved activations per rank "
                     r"\d+\.\d\dx, .*; loss and Psi equal", out, re.M)
    figure = _bench_module("gpu_checks").context_parallel_figure(result)
    assert figure.startswith("seq 256: CP2/CP1 step time ") and "saved activations/rank" in figure


def test_one_gpu_reports_cp2_skipped(toy_run, capsys):
    """With one GPU only CP1 runs: the table, the summary, the RESULT and gpu_checks' figure
    say CP2 was skipped and why (here with the CPU run's CP1 figures)."""
    _, result = toy_run
    bench = _bench_module("context_parallel_step")
    args = SimpleNamespace(**{k: result[k] for k in ("device", "dtype", "layers", "hidden", "seq",
                                                      "micro_batch", "vocab", "jreg_lambda",
                                                     "steps")},
                           threads=1)
    skipped = bench.report(args, result["cp1"], None, "1 GPU here, CP2 needs 2")
    out = capsys.readouterr().out
    assert re.search(r"^step time +\| +[\d.]+ s \| +skipped \| -$", out, re.M)
    assert "summary: CP1 step " in out and out.rstrip().endswith("CP2 skipped: 1 GPU here, "
                                                                 "CP2 needs 2")
    assert skipped["cp2"] is None and skipped["check"] is None
    assert all(value is None for value in skipped["ratios"].values())
    figure = _bench_module("gpu_checks").context_parallel_figure(skipped)
    assert figure.startswith("seq 256: CP1 ") and figure.endswith("CP2 skipped: 1 GPU here, "
                                                                  "CP2 needs 2")


@pytest.mark.parametrize("flags, message", [
    (["--seq", "258"],
     "--seq 258: must be a multiple of 4 (CP2 cuts a sequence into 4 equal chunks); "
                       "try --seq 260"),
    (["--hidden", "100"], "--hidden 100: must be a multiple of 64"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--jreg-lambda", "0"], "--jreg-lambda 0.0: must be > 0"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_bad_flags_are_one_line(flags, message):
    proc = subprocess.run([sys.executable, SCRIPT] + flags, cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("context_parallel_step: ")
    assert message in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_cuda_without_a_gpu_is_one_line():
    proc = subprocess.run([sys.executable, SCRIPT, "--device", "cuda"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("context_parallel_step: --device cuda: no GPU is visible here; "
                           "run with --device cpu\n")
