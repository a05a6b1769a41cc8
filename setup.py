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
    "hf": ["transformers", "safetensors", "gguf"],
    "plot": ["matplotlib"],
    "stats": ["scipy"],
    # tools/eval_downstream.py: lm-evaluation-harness's Python API and its hf backend
    "eval": ["lm_eval[hf]>=0.4.13,<0.5"],
    # megatron_jreg.hf_training in Hugging Face loops: the Trainer (accelerate), TRL's
    # SFTTrainer, PEFT adapters
    "hf-train": ["transformers", "accelerate", "peft", "trl>=1.16,<2"],
}
# the tests cover the optional readers and both t-test paths (scipy and the exact one)
# (pytest-xdist: pytest.ini spreads the suite over the cores; filelock: fixtures built once;
# ruff: `ruff check .` with ruff.toml's rules, pinned so a new release adds no findings)
EXTRAS["test"] = ["pytest>=7", "pytest-xdist>=3.6", "filelock", "ruff==0.17.6", *EXTRAS["data"],
                  *EXTRAS["stats"], *EXTRAS["hf-train"]]


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
    # why CUDA is left out, compiled into the extension for the trainer's start-up line
    # (csrc/bindings.cpp: CUDA_SKIPPED; megatron_jreg.ops.displacement.kernel_build)
    skipped = 1 if skip_cuda else 2 if torch.version.cuda is None else 0 if nvcc else 3
    macros = [("MEGATRON_JREG_CUDA_SKIPPED", str(skipped))]
    if skipped == 0:
        arch_list = default_cuda_arch_list(torch, nvcc)
        if arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
            print("megatron-jreg: no GPU is visible; building for "
                  f"TORCH_CUDA_ARCH_LIST={arch_list} (set it to choose others)")
        print("megatron-jreg: building the fused displacement kernel for CPU and CUDA")
        ext = CUDAExtension(
            "megatron_jreg._C",
            sources + ["csrc/displacement_cuda.cu"],
            define_macros=[("WITH_CUDA", None)] + macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        why = {1: "MEGATRON_JREG_NO_CUDA is set", 2: "torch is a CPU build",
               3: "nvcc was not found (set CUDA_HOME)"}[skipped]
        print(f"megatron-jreg: building the fused displacement kernel for CPU only ({why})")
        ext = CppExtension(
            "megatron_jreg._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"]
        )
    return [ext], {"build_ext": _cached(BuildExtension, nvcc or "nvcc")}


# GPU architectures built when none is visible (a build node), newest last, one per major
# version (a cubin runs on the later minor versions: 8.0 on 8.6 and 8.9); each is kept
# only where the installed nvcc can target it
DEFAULT_CUDA_ARCHS = ("8.0", "9.0", "10.0", "12.0")


def default_cuda_arch_list(torch, nvcc):
    """TORCH_CUDA_ARCH_LIST for a CUDA build on a machine where no GPU is visible, or None
    when it is set or a GPU is visible (torch then builds for the visible GPUs). torch's
    extension builder derives the architectures from the visible GPUs only and fails on
    none (an IndexError on an empty list)."""
    import subprocess

    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.device_count() > 0:
        return None
    try:
        listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True,
                                timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError):
        listed = []
    # compute_90 -> 9.0, compute_100 -> 10.0
    targets = {f"{name[8:-1]}.{name[-1]}" for name in listed if name.startswith("compute_")}
    archs = [arch for arch in DEFAULT_CUDA_ARCHS if arch in targets] or ["8.0", "9.0"]
    return ";".join(archs) + "+PTX"


def cuda_arch_targets():
    """The GPU code a CUDA build of the kernel holds: torch's own nvcc flags
    (``-gencode=arch=compute_90,code=sm_90`` ...), from TORCH_CUDA_ARCH_LIST or, unset or
    ``native``, the GPUs visible to this build (one install on an A100 node, the next on an
    H100 node: two kernels)."""
    import torch
    from torch.utils import cpp_extension

    try:
        return cpp_extension._get_cuda_arch_flags()
    except AttributeError:  # a torch without it: the same two sources, read here
        listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
        if listed and listed != "native":
            return listed
        return sorted({"%d.%d" % torch.cuda.get_device_capability(i)
                       for i in range(torch.cuda.device_count())})


def kernel_cache_key(ext, nvcc):
    """The name of ``ext``'s entry in ``build/kernel-cache/``: a hash of everything the
    binary depends on: every file in csrc/, the sources, macros and flags, torch's version
    and CUDA version, the Python ABI, the C++ compiler's and nvcc's version lines, and for a
    CUDA build the GPU architectures it is compiled for (:func:`cuda_arch_targets`; a
    kernel without code for the GPU it runs on fails at its first launch)."""
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

    digest = hashlib.sha256()
    for name in sorted(os.listdir(os.path.join(ROOT, "csrc"))):
        digest.update(name.encode())
        with open(os.path.join(ROOT, "csrc", name), "rb") as f:
            digest.update(f.read())
    cuda = any(source.endswith(".cu") for source in ext.sources)
    for part in (ext.sources, ext.define_macros, ext.extra_compile_args,
                 ext.extra_link_args, torch.__version__, torch.version.cuda,
                 sys.version, sysconfig.get_config_var("EXT_SUFFIX"),
                 version_line(os.environ.get("CXX", "c++")), version_line(nvcc),
                 cuda_arch_targets() if cuda else None):  # a CPU build has no GPU code
        digest.update(repr(part).encode())
    return digest.hexdigest()[:16]


def _cached(build_ext, nvcc):
    """``build_ext`` that keeps each built extension in ``build/kernel-cache/<key>/``
    (:func:`kernel_cache_key`): a second install from this checkout (other extras, a fresh
    environment over the same torch) copies it instead of compiling again (about 20 s).
    Delete build/ to force a rebuild."""

    class CachedBuildExtension(build_ext):
        def build_extension(self, ext):
            target = self.get_ext_fullpath(ext.name)
            cached = os.path.join(ROOT, "build", "kernel-cache", kernel_cache_key(ext, nvcc),
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
    entry_points={
        # the trainer, and each tool of tools/ under its own name
        "console_scripts": [
            "megatron-jreg-train = megatron_jreg.commands.train:main",
            "megatron-jreg-preprocess = megatron_jreg.commands.preprocess:main",
            "megatron-jreg-eval-jump = megatron_jreg.commands.eval_jump:main",
            "megatron-jreg-eval-downstream = megatron_jreg.commands.eval_downstream:main",
            "megatron-jreg-convert-to-hf = megatron_jreg.commands.convert_to_hf:main",
            "megatron-jreg-convert-from-hf = megatron_jreg.commands.convert_from_hf:main",
            "megatron-jreg-compare-seeds = megatron_jreg.commands.compare_seeds:main",
            "megatron-jreg-make-demo-corpus = megatron_jreg.commands.make_demo_corpus:main",
            "megatron-jreg-train-tokenizer = megatron_jreg.commands.train_tokenizer:main",
        ],
    },
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
)
