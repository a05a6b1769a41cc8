"""bench/checkpoint_startup.py as its docstring runs it (one timed launch per start): the
table it prints has a row per start, and each start opens the source checkpoint's
``common.pt`` and ``.metadata`` once (the count test_source_reads.py asserts in-process)."""

import subprocess
import sys

from checkpoint_runs import REPO, run_env


def test_the_startup_bench_prints_its_table(tmp_path):
    proc = subprocess.run([sys.executable, "bench/checkpoint_startup.py", "--repeats", "1"],
                          cwd=REPO, env=dict(run_env(), TMPDIR=str(tmp_path)),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| start |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    rows = {}
    for line in lines:
        if line.startswith(("| resume |", "| pretrained |")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = dict(zip(columns, cells))
    assert set(rows) == {"resume", "pretrained"}, proc.stdout[-2000:]
    for row in rows.values():
        assert row["common.pt"] == "1" and row[".metadata"] == "1", row
        assert float(row["s to first step"]) > 0
    assert list(tmp_path.glob("ckpt_startup_*")) == []  # its work directory removed
