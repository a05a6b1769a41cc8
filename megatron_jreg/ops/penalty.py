"""Carry an extra loss through backward on the activation that produced it.

``attach_penalty(h, penalty, scale)`` is the identity on ``h``; in backward it also hands
``penalty`` the gradient ``scale``, as if ``scale * penalty`` had been added to the loss.
This is the contract of megatron-core's ``MoEAuxLossAutoScaler`` and OLMo-core's
``attach_auxiliary_loss``: a penalty computed on one pipeline stage gets its gradient on
that stage, and the last stage's loss never needs another stage's tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch


class _PenaltyCarrier(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, penalty: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(penalty)
        ctx.scale = scale
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        (penalty,) = ctx.saved_tensors
        scale = ctx.scale
        if isinstance(scale, torch.Tensor):  # a loss scale on the device: no wait for it
            return grad_h, scale.to(penalty.dtype).expand_as(penalty).clone(), None
        return grad_h, torch.full_like(penalty, scale), None


def attach_penalty(h: torch.Tensor, penalty: torch.Tensor, scale) -> torch.Tensor:
    """``h`` unchanged, carrying ``penalty``'s gradient ``scale`` into backward.

    ``scale`` must be the main loss's own backward scale: with megatron's schedules, the
    optimizer's loss scale divided by the number of micro-batches (the schedule divides the
    LM loss by it): a number, or a 0-dim tensor (the optimizer's scale where it lives, read
    without waiting for the device). The result is a view of ``h`` (a custom Function
    returning its input).
    """
    if isinstance(scale, torch.Tensor):
        return _PenaltyCarrier.apply(h, penalty, scale.detach().reshape(()))
    return _PenaltyCarrier.apply(h, penalty, float(scale))
