"""Autograd ops: the displacement with a fused kernel and a pure-PyTorch reference behind
one entry, and the carrier that injects a penalty's gradient in backward."""

from megatron_jreg.ops.displacement import (
    FusedTokenDisplacement,
    displacement,
    fused_available,
    resolve_impl,
    token_displacement,
    token_displacement_reference,
)
from megatron_jreg.ops.penalty import attach_penalty

__all__ = ["token_displacement", "token_displacement_reference", "displacement",
           "fused_available", "resolve_impl", "FusedTokenDisplacement", "attach_penalty"]
