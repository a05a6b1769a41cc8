"""bench/preprocess_long_line.py as its docstring runs it, with a clone of this repository's
committed tree as the other checkout: a row per checkout with its peak and ratios, and the
two outputs identical."""

import os
import re
import shlex
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "bench", "preprocess_long_line.py")


def _documented_commands():
    import ast
    doc = ast.get_docstring(ast.parse(open(BENCH).read())).replace("\\\n", " ")
    return [line.strip() for line in doc.splitlines()
            if line.strip().startswith("python bench/preprocess_long_line.py")]


def test_the_long_line_bench_runs_as_documented(tmp_path):
    commands = _documented_commands()
    assert commands, "the docstring shows no command"
    other = tmp_path / "other"
    subprocess.run(["git", "clone", "-q", REPO, str(other)], check=True, timeout=300)
    env = dict(os.environ, PYTHONWARNINGS="ignore", TMPDIR=str(tmp_path))
    for command in commands:
        argv = [str(other) if a == "OTHER_CHECKOUT" else a for a in shlex.split(command)]
        argv[0] = sys.executable
        proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        rows = re.findall(r"^  ByteTokenizer +(baseline|this) +peak +(\d+) MiB \( *([0-9.]+)x the "
                          r"line\), growth +(-?[0-9.]+)x the line, .*, ok$", proc.stdout, re.M)
        assert [r[0] for r in rows] == ["baseline", "this"], proc.stdout
        for _, peak, ratio, growth in rows:
            assert int(peak) > 0 and 0 < float(ratio) < 100 and float(growth) < 100, proc.stdout
        assert "  ByteTokenizer  outputs identical" in proc.stdout, proc.stdout
