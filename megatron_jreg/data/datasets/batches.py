"""Micro-batches for one data-parallel rank, and the dataset prefixes of ``--data-path``.

A batch is a dict of [b, s] tensors: tokens, labels, loss_mask, position_ids, and
token_mask (bool, True = a real token, counted by JREG) only where the batch holds padding.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from megatron_jreg.data.datasets.blend import parse_data_path

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "token_mask")


def data_prefixes(data_path: Sequence[str]) -> List[str]:
    """The dataset prefixes of ``--data-path``: plain prefixes, or the prefixes of
    weight/prefix pairs (``0.7 a_text_document 0.3 b_text_document``)."""
    return parse_data_path(data_path)[0]


def rank_microbatches(dataset, start: int, micro_batch_size: int, num_microbatches: int,
                      dp_rank: int, dp_size: int,
                      device: torch.device) -> List[Dict[str, torch.Tensor]]:
    """This DP rank's micro-batches of the global batch starting at sample ``start``
    (Megatron's pretraining sampler order: consecutive chunks of mbs x dp samples)."""
    mbs = micro_batch_size
    batches = []
    for j in range(num_microbatches):
        first = start + j * mbs * dp_size + dp_rank * mbs
        samples = [dataset[(first + k) % len(dataset)] for k in range(mbs)]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                 for key in BATCH_KEYS if key in samples[0]}
        # JREG counts real tokens only; without padding every token counts (the fast path)
        if "token_mask" in batch and bool(batch["token_mask"].all()):
            del batch["token_mask"]
        batches.append({k: v.to(device, non_blocking=True) for k, v in batch.items()})
    return batches
