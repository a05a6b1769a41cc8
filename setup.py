"""Install megatron-jreg. torch must already be installed (see README): the C++/CUDA
extension is built against it, so install with ``pip install --no-build-isolation -e .``."""

from setuptools import find_packages, setup

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
    "test": ["pytest>=7"],
    "hf": ["transformers", "safetensors"],
    "plot": ["matplotlib"],
    "stats": ["scipy"],
}

setup(
    name="megatron-jreg",
    version="0.1.0",
    description="Llama pretraining on megatron-core with the JREG jump-suppressing regularizer",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_jreg", "megatron_jreg.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
)
