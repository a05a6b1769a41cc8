"""bench/gpu_checks.py, the one prepared GPU run, at toy sizes on the CPU: every check
runs and the summary table reports each (the GPU figures come from a lent GPU)."""

import os
import subprocess
import sys

from trainer_runs import REPO, run_env


def test_gpu_checks_quick_on_cpu():
    proc = subprocess.run([sys.executable, "bench/gpu_checks.py", "--device", "cpu", "--quick"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    table = proc.stdout[proc.stdout.index("summary ("):]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines()
            if line.startswith("| ")}
    for check in ("op bandwidth", "JREG step overhead", "3b flags x2, local"):
        assert "| ok " in rows[check], rows[check]
    # the attention each step built is the one the row names
    for check, attention in (("170m sdpa", "sdpa"), ("1b sdpa", "sdpa"), ("1b unfused", "megatron")):
        for jreg in ("off", "on"):
            row = rows[f"{check}, JREG {jreg}"]
            assert "| ok " in row and f"tok/s" in row and f"attention {attention}" in row, row
        assert "| ok " in rows[f"{check}: JREG on/off step time"]
    assert "skipped" in rows["1b TE, JREG on"] or "attention transformer_engine" in rows["1b TE, JREG on"]
    assert "fused" in table
    assert os.path.exists(os.path.join(REPO, "bench", "gpu_checks.sh"))
