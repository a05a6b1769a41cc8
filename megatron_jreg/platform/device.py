"""The device mapping: which device a run's tensors live on and which backend its
collectives use; a tool's ``--device``, the CUDA generator's state and the memory figure.
Every other module asks here instead of testing the device itself, so a CPU run (CI) and a
GPU run take the same code paths (docs/design.md, "Where the code branches on the device").
"""

from __future__ import annotations

import os
import struct
from typing import Optional

import psutil
import torch

from megatron_jreg.errors import InputError


def use_cpu() -> bool:
    """CPU when no GPU is present or MEGATRON_JREG_DEVICE=cpu is set."""
    return (os.environ.get("MEGATRON_JREG_DEVICE", "").lower() == "cpu"
            or not torch.cuda.is_available())


def device_type() -> str:
    """``cpu`` or ``cuda``: where this run's tensors live."""
    return "cpu" if use_cpu() else "cuda"


def backend() -> str:
    """The process-group backend for this device: gloo on CPU, NCCL on GPUs."""
    return "gloo" if use_cpu() else "nccl"


def current_device() -> torch.device:
    """This rank's tensor device (its GPU once ``initialize_distributed`` set it)."""
    return torch.device("cpu") if use_cpu() else torch.device("cuda", torch.cuda.current_device())


def collective_device() -> torch.device:
    """Where a tensor handed to a collective of the default group must live: NCCL takes
    GPU tensors only, gloo CPU ones (a tool may measure on the CPU under a GPU world)."""
    import torch.distributed as dist

    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def resolve_device(device: str) -> torch.device:
    """A tool's ``--device`` as a torch.device, checked before any model loads; a bad name
    or a missing GPU is an InputError."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device {device}: not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here; use --device cpu")
    return dev


def cuda_generator_state() -> Optional[torch.Tensor]:
    """The CUDA generator's state where CUDA runs in this process; None on a CPU run."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.get_rng_state()
    return None


def seeded_cuda_generator_state(seed: int) -> torch.Tensor:
    """The state ``torch.cuda.manual_seed(seed)`` leaves in a CUDA generator, made without
    CUDA: Philox's seed and a zero offset as two little-endian 64-bit integers, the 16 bytes
    ``torch.cuda.get_rng_state`` returns (``bench/gpu_checks.py`` compares them on a GPU)."""
    return torch.frombuffer(bytearray(struct.pack("<Qq", seed, 0)), dtype=torch.uint8)


def set_cuda_generator_state(state: torch.Tensor) -> None:
    """Restore :func:`cuda_generator_state`'s state where CUDA is present."""
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)


def peak_memory_gib(device: torch.device) -> float:
    """Peak GPU memory allocated on a GPU, the process's resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return psutil.Process().memory_info().rss / 2**30


def memory_capacity() -> int:
    """Bytes this process can hold on its device: the GPU's memory, else the host's (or
    the address-space limit, ``ulimit -v``, where lower)."""
    if not use_cpu():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    total = int(psutil.virtual_memory().total)
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return total
    return total if limit == resource.RLIM_INFINITY else min(total, int(limit))
