"""The tools' flags (``cli.tool_parser``/``tool_values``) get the trainer's value check: a
float must be finite unless its field allows it, a value must lie in the range its field's
metadata declares; one line, exit 2, naming the flag and the value."""

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from megatron_jreg.commands import flags as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(kw_only=True)
class ToolConfig:
    inputs: List[float] = field(metadata={"positional": True, "nargs": "+", "min": 0})
    rate: float = field(default=0.5, metadata={"gt": 0, "lt": 1})
    steps: int = field(default=3, metadata={"min": 1, "max": 10})
    scale: Optional[float] = None
    ceiling: float = field(default=float("inf"), metadata={"finite": False})


def values(argv):
    return cli.tool_values({None: ToolConfig}, argv, prog="tool")[None]


@pytest.mark.parametrize("argv,message", [
    (["1", "--rate", "0"], "--rate must be in (0, 1), got 0.0"),
    (["1", "--rate", "1"], "--rate must be in (0, 1), got 1.0"),
    (["1", "--rate", "nan"], "--rate must be a finite number in (0, 1), got nan"),
    (["1", "--steps", "0"], "--steps must be in [1, 10], got 0"),
    (["1", "--steps", "11"], "--steps must be in [1, 10], got 11"),
    (["1", "--scale", "inf"], "--scale must be a finite number, got inf"),
    (["1", "--scale=-inf"], "--scale must be a finite number, got -inf"),
    (["1", "-2"], "inputs must be >= 0, got -2.0"),  # each element of a list
    (["1", "nan"], "inputs must be a finite number >= 0, got nan"),
])
def test_tool_flag_value_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        values(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err == f"tool: error: {message}\n"


def test_tool_flag_values_in_range_and_defaults_pass():
    got = values(["0", "2.5", "--rate", "0.25", "--steps", "10", "--ceiling", "inf"])
    assert got == {"inputs": [0.0, 2.5], "rate": 0.25, "steps": 10, "scale": None,
                   "ceiling": float("inf")}
    assert values(["1"])["ceiling"] == float("inf")  # a default is the program's own


@pytest.mark.parametrize("argv,message", [
    # used to fail later with a traceback (int(inf) in the --limit handling)
    ([sys.executable, "tools/eval_downstream.py", "--load", "x",
      "--limit", "inf"], "eval_downstream: error: --limit must be a finite number, got inf"),
    ([sys.executable, "tools/make_demo_corpus.py", "--output", "never.jsonl",
      "--max-mb", "nan"],
     "--max-mb must be a finite number, got nan"),
])
def test_real_tools_refuse_non_finite_values(argv, message):
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1
