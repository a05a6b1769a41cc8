"""The device mapping: which device a run's tensors live on and which backend its
collectives use. Every other module asks here instead of testing the device itself, so a
CPU run (CI) and a GPU run take the same code paths; docs/design.md lists the few places
that still branch on the device and the CPU tests that run their GPU arms.
"""

from __future__ import annotations

import os

import torch


def use_cpu() -> bool:
    """CPU when no GPU is present or MEGATRON_JREG_DEVICE=cpu is set."""
    return os.environ.get("MEGATRON_JREG_DEVICE", "").lower() == "cpu" or not torch.cuda.is_available()


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
