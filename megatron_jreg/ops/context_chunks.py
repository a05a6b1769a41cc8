"""The split of a sequence over the context-parallel (CP) group: megatron-core's rule.

The sequence is cut into 2·CP equal chunks and CP rank i holds chunks i and 2·CP−1−i, in
that order, so every rank has the same causal attention work. Everything split along the
sequence under CP (the batch, the loss mask, JREG's token mask, the position ids) is split
here; megatron-core's rotary embedding slices its positions the same way itself.
"""

from __future__ import annotations

from typing import Tuple

import torch


def chunk_ids(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two chunks of the sequence (of 2·CP) that CP rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def local_part(tensor: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim`` (the full sequence), concatenated.
    The length along ``dim`` must be a multiple of 2·CP."""
    if cp_size == 1:
        return tensor
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ValueError(f"context parallelism: a sequence of {length} tokens does not split "
                         f"into {2 * cp_size} equal chunks (2 x --context-parallel-size {cp_size})")
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(cp_size, cp_rank)], dim=dim)
