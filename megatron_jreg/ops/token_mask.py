"""A micro-batch's token mask in the layout of one rank's hidden states.

The data gives a ``[b, s]`` bool mask (True = a real token, counted by JREG). Inside the
decoder the hidden states are ``[s, b, h]``, and under sequence parallelism each TP rank
holds its chunk of the sequence, ``[s / tp, b, h]``. The training tracker and the
measurement tools both take their rank's slice through this one function.
"""

from __future__ import annotations

import torch


def local_token_mask(mask: torch.Tensor, sequence_parallel: bool, tp_rank: int = 0,
                     tp_size: int = 1) -> torch.Tensor:
    """``mask`` [b, s] -> this rank's [s_local, b] (contiguous): the whole sequence, or the
    TP rank's chunk along it under sequence parallelism. The full mask is known on every TP
    rank, so no communication is needed."""
    local = mask.t()  # [s, b]
    if sequence_parallel and tp_size > 1:
        local = local.chunk(tp_size, dim=0)[tp_rank]  # [s / tp, b]
    return local.contiguous()
