"""setup.py's kernel cache (build/kernel-cache/<key>/) is keyed by the GPU architectures a
CUDA build compiles for: a kernel built on a node of one GPU type is not copied into an
install on another (it has no code for that GPU and fails at its first launch). Simulated in
a subprocess on this CPU machine, as tests/ops/test_cuda_arch_default.py does: torch reports
a CUDA version and the visible GPUs given here, CUDA_HOME points at the nvcc on PATH,
setuptools' setup() is not run; the key setup.py gives the CUDA extension is read back."""

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
torch.version.cuda = "13.0"                                    # a CUDA build of torch
ext.CUDA_HOME = os.path.dirname(os.path.dirname(sys.argv[1]))  # nvcc found
gpus = json.loads(sys.argv[2])                                  # visible GPUs' capabilities
torch.cuda.device_count = lambda: len(gpus)
torch.cuda.get_device_capability = lambda i=0: tuple(gpus[i])
torch.cuda.get_arch_list = lambda: ["sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
flags = ext._get_cuda_arch_flags
if sys.argv[3] == "without":                                    # a torch without the helper
    del ext._get_cuda_arch_flags
setup = runpy.run_path("setup.py")
[extension] = setup["EXT_MODULES"]
print("RESULT " + json.dumps({"key": setup["kernel_cache_key"](extension, sys.argv[1]),
                              "cuda": any(s.endswith(".cu") for s in extension.sources),
                              "flags": flags()}))
"""


def key(gpus, arch_list=None, helper="with"):
    env = dict(os.environ)
    env.pop("TORCH_CUDA_ARCH_LIST", None)
    if arch_list is not None:
        env["TORCH_CUDA_ARCH_LIST"] = arch_list
    proc = subprocess.run([sys.executable, "-c", SIMULATE, NVCC, json.dumps(gpus), helper],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1][7:])
    assert result["cuda"]  # the CUDA extension is the one keyed
    return result


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_the_key_follows_the_visible_gpus_when_no_arch_list_is_set():
    a100, h100 = key([[8, 0]]), key([[9, 0]])
    assert a100["flags"] != h100["flags"]  # torch compiles for the visible GPU
    assert a100["key"] != h100["key"]
    assert key([[8, 0]])["key"] == a100["key"]  # the same node type reuses its kernel
    assert key([[9, 0], [8, 0]])["key"] not in (a100["key"], h100["key"])


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_the_key_follows_the_arch_list():
    hopper = key([], "9.0")
    assert hopper["key"] != key([], "8.0;9.0+PTX")["key"]
    # the list decides, not the GPU of the node that builds
    assert key([[8, 0]], "9.0")["key"] == hopper["key"]


@pytest.mark.skipif(NVCC is None, reason="no nvcc on PATH")
def test_without_torchs_arch_helper_the_key_still_follows_the_gpus():
    """setup.py reads the arch list or the visible GPUs itself where torch lacks the private
    helper it asks first."""
    a100, h100 = key([[8, 0]], helper="without"), key([[9, 0]], helper="without")
    assert a100["key"] != h100["key"]
    hopper, ampere = (key([[8, 0]], archs, helper="without") for archs in ("9.0", "8.0"))
    assert hopper["key"] != ampere["key"]
