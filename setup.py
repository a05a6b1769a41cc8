"""Install megatron-jreg. torch must already be installed (see README): the C++/CUDA
extension is built against it, so install with ``pip install --no-build-isolation -e .``."""

import os
import shutil

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))

INSTALL_REQUIRES = [
    "torch>=2.4",
    "megatron-core==0.16.1",  # the version tested; see docs/design.md for the CPU redirections
    "psutil",  # dist-checkpointing's writer needs it (undeclared by megatron-core 0.16.1)
    "numpy",
    "pyyaml",
    "tqdm",
    "sentencepiece",
    "tokenizers",
    "tensorboard",
]

EXTRAS = {
    # input formats of tools/preprocess_data.py: .zst, Parquet, --split-sentences
    "data": ["zstandard", "pyarrow", "nltk"],
    "hf": ["transformers", "safetensors"],
    "plot": ["matplotlib"],
    "stats": ["scipy"],
    # tools/eval_downstream.py: lm-evaluation-harness's Python API and its hf backend
    "eval": ["lm_eval[hf]>=0.4.13,<0.5"],
}
# the tests cover the optional readers and both t-test paths (scipy and the exact one)
# (pytest-xdist: pytest.ini spreads the suite over the cores; filelock: fixtures built once)
EXTRAS["test"] = ["pytest>=7", "pytest-xdist>=3.6", "filelock", *EXTRAS["data"], *EXTRAS["stats"]]


def _extension_build():
    """The fused displacement extension ``megatron_jreg._C``: the CPU kernel always, the CUDA
    kernel when torch is a CUDA build and nvcc is found (MEGATRON_JREG_NO_CUDA=1 skips it).
    A compile error fails the install; it never turns into an import error later."""
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as err:
        raise RuntimeError(
            "megatron-jreg builds a C++ extension against the installed torch: install torch "
            "first, then `pip install --no-build-isolation -e .`"
        ) from err

    sources = ["csrc/bindings.cpp", "csrc/displacement_cpu.cpp", "csrc/displacement_cuda_glue.cpp"]
    cxx = ["-O3", "-fopenmp"]
    skip_cuda = os.environ.get("MEGATRON_JREG_NO_CUDA", "0") not in ("", "0")
    nvcc = CUDA_HOME is not None and shutil.which(os.path.join(CUDA_HOME, "bin", "nvcc"))
    if torch.version.cuda is not None and nvcc and not skip_cuda:
        print("megatron-jreg: building the fused displacement kernel for CPU and CUDA")
        ext = CUDAExtension(
            "megatron_jreg._C",
            sources + ["csrc/displacement_cuda.cu"],
            define_macros=[("WITH_CUDA", None)],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        why = (
            "MEGATRON_JREG_NO_CUDA is set" if skip_cuda
            else "torch is a CPU build" if torch.version.cuda is None
            else "nvcc was not found (set CUDA_HOME)"
        )
        print(f"megatron-jreg: building the fused displacement kernel for CPU only ({why})")
        ext = CppExtension(
            "megatron_jreg._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": _cached(BuildExtension, nvcc or "nvcc")}


def _cached(build_ext, nvcc):
    """``build_ext`` that keeps each built extension in ``build/kernel-cache/<key>/``: a
    second install from this checkout (other extras, a fresh environment over the same
    torch) copies it instead of compiling again (about 20 s). The key hashes everything the
    binary depends on: every file in csrc/, the sources, macros and flags, torch's version
    and CUDA version, the Python ABI, the C++ compiler's and nvcc's version lines and
    TORCH_CUDA_ARCH_LIST. Delete build/ to force a rebuild."""
    import hashlib
    import subprocess
    import sys
    import sysconfig

    import torch

    def version_line(cmd):
        try:
            out = subprocess.run([cmd, "--version"], capture_output=True, text=True, timeout=60)
            return out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else ["absent"]
        except (OSError, subprocess.SubprocessError):
            return ["absent"]

    class CachedBuildExtension(build_ext):
        def build_extension(self, ext):
            digest = hashlib.sha256()
            for name in sorted(os.listdir(os.path.join(ROOT, "csrc"))):
                digest.update(name.encode())
                with open(os.path.join(ROOT, "csrc", name), "rb") as f:
                    digest.update(f.read())
            for part in (ext.sources, ext.define_macros, ext.extra_compile_args,
                         ext.extra_link_args, torch.__version__, torch.version.cuda,
                         sys.version, sysconfig.get_config_var("EXT_SUFFIX"),
                         version_line(os.environ.get("CXX", "c++")), version_line(nvcc),
                         os.environ.get("TORCH_CUDA_ARCH_LIST")):
                digest.update(repr(part).encode())
            target = self.get_ext_fullpath(ext.name)
            cached = os.path.join(ROOT, "build", "kernel-cache", digest.hexdigest()[:16],
                                  os.path.basename(target))
            if os.path.isfile(cached):
                print(f"megatron-jreg: the kernel for these sources and this torch is already "
                      f"built: {os.path.relpath(cached, ROOT)}")
                os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
                shutil.copyfile(cached, target)
                return
            super().build_extension(ext)
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            shutil.copyfile(target, cached + ".tmp")
            os.replace(cached + ".tmp", cached)

    return CachedBuildExtension


EXT_MODULES, CMDCLASS = _extension_build()

setup(
    name="megatron-jreg",
    version="0.1.0",
    description="Llama pretraining on megatron-core with the JREG jump-suppressing regularizer",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_jreg", "megatron_jreg.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
