"""bench/gpu_checks.py, the one prepared GPU run, at toy sizes on the CPU: every check
runs and the summary table reports each (the GPU figures come from a lent GPU)."""

import os
import subprocess
import sys

from conftest import REPO, run_env


def test_gpu_checks_quick_on_cpu():
    proc = subprocess.run([sys.executable, "bench/gpu_checks.py", "--device", "cpu", "--quick"],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    table = proc.stdout[proc.stdout.index("summary ("):]
    for check in ("op bandwidth", "JREG step overhead", "3b flags x2, local", "170m tokens/s, MFU"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {check}"))
        assert "| ok " in row, row
    assert "tok/s" in table and "fused" in table
    assert os.path.exists(os.path.join(REPO, "bench", "gpu_checks.sh"))
