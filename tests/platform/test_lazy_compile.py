"""megatron-core's torch.compile decorations run on a function's first call, not at import
(megatron_jreg.platform.lazy_compile)."""

import json
import os
import subprocess
import sys

from megatron_jreg.platform.lazy_compile import on_first_call

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A fresh process: torch.compile is replaced by a spy that records each call and returns
# the function uncompiled, then megatron-core's fusions are imported after megatron_jreg
# (or before it, FIRST=mcore) and one of them is called twice.
PROBE = r"""
import json, os, sys
import torch
calls = []
def spy(fn=None, **options):
    calls.append((fn.__qualname__, options))
    return fn
torch.compile = spy
if os.environ["FIRST"] == "mcore":
    import megatron.core
import megatron_jreg
from megatron.core.fusions import fused_bias_gelu
at_import = list(calls)
x, b = torch.linspace(-2, 2, 16), torch.linspace(1, -1, 16)
first = fused_bias_gelu.bias_gelu(b, x)
fused_bias_gelu.bias_gelu(b, x)
eager = getattr(fused_bias_gelu.bias_gelu, "__wrapped__", fused_bias_gelu.bias_gelu)(b, x)
print("PROBE " + json.dumps({
    "at_import": len(at_import), "after_calls": calls[len(at_import):],
    "dynamo_imported": "torch._dynamo" in sys.modules,
    "equal": bool(torch.equal(first, eager))}))
"""


def probe(first):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", FIRST=first)
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("PROBE ", 1)[1])


def test_import_compiles_nothing_and_the_first_call_compiles_the_function_once():
    result = probe("megatron_jreg")
    assert result["at_import"] == 0  # megatron-core decorates ~40 functions at import
    assert result["after_calls"] == [["bias_gelu", {}]]  # once, the original, no options
    assert result["equal"]
    assert not result["dynamo_imported"]  # the import time this saves


def test_megatron_core_imported_first_keeps_its_eager_decoration():
    result = probe("mcore")
    assert result["at_import"] >= 20  # what megatron.core itself imports
    assert result["after_calls"] == []


def test_on_first_call_forwards_options_and_compiles_once():
    compiled = []

    def fake_compile(fn, **options):
        compiled.append((fn.__name__, options))
        return lambda *args: ("compiled", fn(*args))

    lazy = on_first_call(fake_compile)

    @lazy
    def square(x):
        return x * x

    @lazy(dynamic=True)
    def cube(x):
        return x ** 3

    assert compiled == [] and square.__name__ == "square"
    assert square(3) == ("compiled", 9) and square(4) == ("compiled", 16)
    assert cube(2) == ("compiled", 8)
    assert compiled == [("square", {}), ("cube", {"dynamic": True})]
