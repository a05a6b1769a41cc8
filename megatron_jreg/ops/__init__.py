"""Autograd ops with a fused kernel and a pure-PyTorch reference behind one entry."""

from megatron_jreg.ops.displacement import token_displacement, fused_available

__all__ = ["token_displacement", "fused_available"]
