"""The ``--device`` flag of the measuring tools, checked before any model loads."""

from __future__ import annotations

import torch

from megatron_jreg.errors import InputError


def resolve_device(device: str) -> torch.device:
    """``device`` as a torch.device; a bad name or a missing GPU is an InputError."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device {device}: not a device name; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available here; use --device cpu")
    return dev
