"""Per-token displacement psi = (1 - cos(a, b)) / 2: fused kernel or PyTorch reference."""

from __future__ import annotations

import torch

from megatron_jreg.jreg import token_displacement_reference

IMPLS = ("auto", "fused", "torch")


def fused_available(device: torch.device) -> bool:
    """True when the fused kernel is built for tensors on ``device``."""
    return False


def token_displacement(a: torch.Tensor, b: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """Per-token psi in fp32, shape of ``a`` without its last dimension; differentiable."""
    if impl not in IMPLS:
        raise ValueError(f"token_displacement: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "fused" and not fused_available(a.device):
        raise RuntimeError(
            f"token_displacement: impl='fused' but the fused kernel is not built for "
            f"{a.device.type}; reinstall with the extension or use impl='torch'"
        )
    return token_displacement_reference(a, b)
