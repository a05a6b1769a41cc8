"""Causal attention over a sequence split across the context-parallel (CP) group, for the SDPA
attention (``model/attention.py``); Transformer Engine's attention does its own.

With megatron-core's split (``ops.context_chunks``: rank i holds chunks i and 2·CP−1−i of 2·CP),
each rank all-gathers the keys and values of the whole sequence (gradients reduce-scattered
back) and attends its two query chunks, each to the keys up to its own end. Shapes: query
[b, np, sq, hn] (sq = 2·L); key and value [b, ng, 2·CP·L, hn] (:func:`gather_sequence`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron_jreg.ops.context_chunks import chunk_ids


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 over ``group`` (rank order); backward: the gradient summed
    over the group and each rank's part returned to it (reduce-scatter)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = tensor.new_empty((size * tensor.shape[0],) + tuple(tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // size,) + tuple(grad.shape[1:]))
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """[2·L, ...] of this rank's two chunks -> [2·CP·L, ...] of the whole sequence, in
    sequence order (the inverse of :func:`local_part` along dim 0, over ``group``)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    gathered = _GatherFirstDim.apply(tensor, group).chunk(2 * size)  # rank r: 2r, 2r+1
    ordered = [None] * (2 * size)
    for rank in range(size):
        first, second = chunk_ids(size, rank)
        ordered[first], ordered[second] = gathered[2 * rank], gathered[2 * rank + 1]
    return torch.cat(ordered)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int, cp_rank: int,
           scale: float, dropout: float = 0.0, gqa: bool = False,
           key_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of this rank's query chunks ``q`` [b, np, 2·L, hn] over the whole
    sequence's keys and values ``k``, ``v`` [b, ng, 2·CP·L, hn]; [b, np, 2·L, hn].
    ``key_valid`` [b, 2·CP·L] (True = attend) masks keys out too, e.g. padding (a query
    with no key left is NaN, as in SDPA over the whole sequence)."""
    length = q.shape[2] // 2
    if q.shape[2] != 2 * length or k.shape[2] != 2 * cp_size * length:
        raise ValueError(f"context parallelism: {q.shape[2]} query and {k.shape[2]} key tokens "
                         f"are not 2 chunks of a sequence in {2 * cp_size}")
    outputs = []
    for part, chunk in enumerate(chunk_ids(cp_size, cp_rank)):
        query = q[:, :, part * length:(part + 1) * length]
        end = (chunk + 1) * length  # keys up to this chunk's end
        if key_valid is None:
            mask = causal_lower_right(length, end)
        else:
            causal = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(end - length)
            mask = causal[None, None] & key_valid[:, None, None, :end]
        out = F.scaled_dot_product_attention(query, k[:, :, :end], v[:, :, :end], attn_mask=mask,
                                             dropout_p=dropout, scale=scale, enable_gqa=gqa)
        outputs.append(out)
    return torch.cat(outputs, dim=2)
