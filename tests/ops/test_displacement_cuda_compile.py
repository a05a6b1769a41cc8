"""The CUDA side compiles on a machine without a GPU: the kernel with nvcc for sm_80 and
sm_90, and the ATen glue's CUDA branch (-DWITH_CUDA) with the host compiler against the
installed torch headers. Compile only; running it is test_token_displacement.py's gpu tests."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"


def _nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else shutil.which("nvcc")


def _torch_flags():
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    return includes, list(cpp_extension.COMMON_NVCC_FLAGS)


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (set CUDA_HOME)")
def test_cuda_kernel_compiles_for_sm80_and_sm90(tmp_path):
    includes, nvcc_flags = _torch_flags()
    cmd = [
        _nvcc(), "-std=c++20", "-O3", *nvcc_flags, *includes, f"-I{CSRC}",
        "-Xcompiler", "-fPIC",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-c", str(CSRC / "displacement_cuda.cu"), "-o", str(tmp_path / "displacement_cuda.o"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    assert (tmp_path / "displacement_cuda.o").stat().st_size > 0
    cuobjdump = Path(_nvcc()).with_name("cuobjdump")
    if cuobjdump.exists():
        listing = subprocess.run([str(cuobjdump), "--list-elf", str(tmp_path / "displacement_cuda.o")],
                                 capture_output=True, text=True, timeout=60).stdout
        assert "sm_80" in listing and "sm_90" in listing, listing


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_cuda_glue_compiles_with_cuda_enabled():
    includes, _ = _torch_flags()
    cmd = [
        "c++", "-std=c++20", "-fsyntax-only", "-DWITH_CUDA", *includes, f"-I{CSRC}",
        str(CSRC / "displacement_cuda_glue.cpp"),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
