"""The CUDA side builds on a machine without a GPU: the kernel's machine code with nvcc for
sm_80 and sm_90 (checked in the cubins' ELF headers and symbol tables, and with cuobjdump
where the toolkit ships it), and the ATen glue's CUDA branch (-DWITH_CUDA) as an object
with the host compiler against the installed torch headers. Running it is
test_token_displacement.py's gpu tests."""

import os
import shutil
import struct
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


def _cubin_arch(path: Path) -> int:
    """The SM architecture a CUDA ELF (cubin) was built for, from its ELF header."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF", f"{path.name} is not an ELF file"
    machine, = struct.unpack_from("<H", data, 18)
    assert machine == 190, f"{path.name}: e_machine {machine}, not EM_CUDA (190)"
    flags, = struct.unpack_from("<I", data, 48)
    # CUDA 13 keeps the SM in bits 8-15 of e_flags; older toolkits in bits 0-7
    return (flags >> 8) & 0xFF if flags & 0xFF00 else flags & 0xFF


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (set CUDA_HOME)")
@pytest.mark.parametrize("arch", [80, 90])
def test_cuda_kernel_builds_machine_code_for_sm80_and_sm90(tmp_path, arch):
    """Real machine code (a cubin, not -fsyntax-only) per architecture: its ELF header names
    the SM, and it holds the forward and backward kernels for every dtype the op takes."""
    includes, nvcc_flags = _torch_flags()
    cubin = tmp_path / f"displacement_sm{arch}.cubin"
    cmd = [
        _nvcc(), "-std=c++20", "-O3", *nvcc_flags, *includes, f"-I{CSRC}", "-cubin",
        "-gencode", f"arch=compute_{arch},code=sm_{arch}",
        str(CSRC / "displacement_cuda.cu"), "-o", str(cubin),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    assert _cubin_arch(cubin) == arch
    assert shutil.which("readelf"), "readelf (binutils) is needed to list the cubin's kernels"
    symbols = subprocess.run(["readelf", "-sW", str(cubin)], capture_output=True, text=True,
                             timeout=60).stdout
    kernels = [line.split()[-1] for line in symbols.splitlines() if " FUNC " in line]
    for kind in ("forward_kernel", "backward_kernel"):
        for dtype in ("If", "Id", "I6__half", "I13__nv_bfloat16"):  # float, double, half, bf16
            assert any(kind + dtype in name for name in kernels), (kind, dtype, kernels)
    cuobjdump = Path(_nvcc()).resolve().with_name("cuobjdump")
    if cuobjdump.exists():  # the toolkit's own listing, where it ships
        listing = subprocess.run([str(cuobjdump), "--list-elf", str(cubin)],
                                 capture_output=True, text=True, timeout=60).stdout
        assert f"sm_{arch}" in listing, listing


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found (set CUDA_HOME)")
def test_cuda_kernel_object_holds_both_architectures(tmp_path):
    """The object the install links (-c, both -gencode targets) embeds a fat binary."""
    includes, nvcc_flags = _torch_flags()
    obj = tmp_path / "displacement_cuda.o"
    cmd = [
        _nvcc(), "-std=c++20", "-O3", *nvcc_flags, *includes, f"-I{CSRC}",
        "-Xcompiler", "-fPIC",
        "-gencode", "arch=compute_80,code=sm_80",
        "-gencode", "arch=compute_90,code=sm_90",
        "-c", str(CSRC / "displacement_cuda.cu"), "-o", str(obj),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    sections = subprocess.run(["readelf", "-SW", str(obj)], capture_output=True, text=True,
                              timeout=60).stdout
    assert ".nv_fatbin" in sections, sections
    # two cubins (one per SM) inside the fat binary
    assert obj.read_bytes().count(b"\x7fELF") >= 3  # the host object and the two cubins


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler")
def test_cuda_glue_builds_with_cuda_enabled(tmp_path):
    """The ATen glue's CUDA branch compiles to an object that defines the CUDA entry points."""
    includes, _ = _torch_flags()
    obj = tmp_path / "glue.o"
    cmd = [
        "c++", "-std=c++20", "-O1", "-fPIC", "-c", "-DWITH_CUDA", *includes, f"-I{CSRC}",
        str(CSRC / "displacement_cuda_glue.cpp"), "-o", str(obj),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True,
                             text=True, timeout=60).stdout
    for entry in ("displacement_forward_cuda", "displacement_backward_cuda", "cuda_built"):
        assert entry in symbols, (entry, symbols[:2000])
