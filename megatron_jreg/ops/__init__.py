"""Autograd ops with a fused kernel and a pure-PyTorch reference behind one entry."""

from megatron_jreg.ops.displacement import (
    FusedTokenDisplacement,
    fused_available,
    resolve_impl,
    token_displacement,
)

__all__ = ["token_displacement", "fused_available", "resolve_impl", "FusedTokenDisplacement"]
