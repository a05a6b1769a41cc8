"""The trainer's TFLOP/s/GPU figure rests on model_flops_per_token; it is checked against
torch's FlopCounterMode over a real forward+backward."""

import json
import os
import subprocess
import sys

from trainer_runs import REPO, run_env


def test_flops_formula_matches_counted_matmuls():
    probe = os.path.join(REPO, "tests", "training", "flops_probe.py")
    proc = subprocess.run([sys.executable, probe], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["counted"] > 0
    assert out["formula"] == out["counted"]
