"""setup.py on a build node: a CUDA build of torch and nvcc, but no GPU visible. torch's
extension builder takes the architectures from the visible GPUs and fails on none (an
IndexError on an empty list), so setup.py defaults TORCH_CUDA_ARCH_LIST to the
architectures this nvcc can target. Simulated in a subprocess on this CPU machine: torch
reports a CUDA version, CUDA_HOME points at the nvcc on PATH, setuptools' setup() is not
run; setup.py's own extension choice and torch's own arch flags are read back."""

import json
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")

SIMULATE = r"""
import json, os, runpy, sys
import setuptools, torch
import torch.utils.cpp_extension as ext
setuptools.setup = lambda **kw: None
torch.version.cuda = "13.0"                        # a CUDA build of torch
ext.CUDA_HOME = os.path.dirname(os.path.dirname(sys.argv[1]))  # nvcc found
assert torch.cuda.device_count() == 0              # no GPU visible
def arch_flags():
    try:
        return ext._get_cuda_arch_flags()
    except IndexError:
        return "IndexError"
before = arch_flags()
[extension] = runpy.run_path("setup.py")["EXT_MODULES"]
print("RESULT " + json.dumps({"before": before, "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"),
                              "cuda_source": "csrc/displacement_cuda.cu" in extension.sources,
                              "macros": dict(extension.define_macros), "flags": arch_flags()}))
"""


def simulate(**env):
    full = dict(os.environ, **env)
    if "TORCH_CUDA_ARCH_LIST" not in env:
        full.pop("TORCH_CUDA_ARCH_LIST", None)
    proc = subprocess.run([sys.executable, "-c", SIMULATE, NVCC], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):]), proc.stdout


def nvcc_targets():
    listed = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True,
                            text=True).stdout.split()
    return {f"{name[8:-1]}.{name[-1]}" for name in listed if name.startswith("compute_")}


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_arch_list_defaults_when_no_gpu_is_visible():
    result, out = simulate()
    assert result["before"] == "IndexError"  # what torch does without the default
    assert result["cuda_source"] and result["macros"] == {"WITH_CUDA": None,
                                                         "MEGATRON_JREG_CUDA_SKIPPED": "0"}
    archs = result["arch_list"].removesuffix("+PTX").split(";")
    expected = [a for a in ("8.0", "9.0", "10.0", "12.0") if a in nvcc_targets()]
    assert archs == expected and expected  # what this nvcc can target, newest last
    assert f"TORCH_CUDA_ARCH_LIST={result['arch_list']}" in out  # said at install
    # torch's own flags now: machine code for each, PTX for the newest
    codes = {flag.rsplit("code=", 1)[1] for flag in result["flags"]}
    assert codes == {f"sm_{a.replace('.', '')}"
                     for a in archs} | {f"compute_{archs[-1].replace('.', '')}"}


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_a_given_arch_list_is_kept():
    result, _ = simulate(TORCH_CUDA_ARCH_LIST="9.0")
    assert result["arch_list"] == "9.0"
    assert result["flags"] == ["-gencode=arch=compute_90,code=sm_90"]
