"""The data checked against the run before any work: token ids within the tokenizer's
vocabulary, and (``--sft``) a loss token somewhere in the train split.

Ids past the tokenizer's vocabulary either land in the embedding's padding rows (rows
that train silently on nothing the tokenizer can decode) or past the table (an
``IndexError`` from ``F.embedding``, a device-side assert on a GPU). The one pass over each
``.bin`` is cached by content (``token_range``); a pass not cached is shared by the ranks,
each scanning its own slice, rather than every rank reading all of it at once (or all but
one waiting, past the process group's timeout on big data, while rank 0 reads it alone).
"""

from __future__ import annotations

import os
from typing import List, Optional, Sequence, Tuple

from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.data.datasets.sft_samples import refuse_no_loss_tokens
from megatron_jreg.data.datasets.token_range import (
    cached_max_token_id,
    max_token_id,
    scan_max_token_id,
    store_max_token_id,
)
from megatron_jreg.errors import InputError


def default_cache_dir(prefixes: Sequence[str], cache_dir: Optional[str]) -> str:
    """``--data-cache-path``, or megatron's index cache beside the first dataset."""
    return cache_dir or os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index-cache")


def check_data_against_run(prefixes: Sequence[str], vocab_size: int,
                           cache_dir: Optional[str] = None,
                           sft: Optional[Tuple[str, int]] = None) -> None:
    """Raise InputError (the same one line on every rank) when the data cannot train.

    ``vocab_size``: the tokenizer's own (not the padded embedding's); ``sft``: (``--split``,
    ``--seq-length``) for ``--sft`` data. Collective when torch.distributed is initialized.
    """
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank0 = not distributed or dist.get_rank() == 0
    problem = None
    try:
        largest = max_token_ids(prefixes, default_cache_dir(prefixes, cache_dir))
        for prefix, top in zip(prefixes, largest):
            if top >= vocab_size:
                raise InputError(
                    f"--data-path {prefix!r}: its largest token id is {top}, past the run's "
                    f"tokenizer vocabulary of {vocab_size} ids: the data was tokenized with "
                    f"another tokenizer; train with the tokenizer the data was built with "
                    f"(--tokenizer-type, --tokenizer-model), or rebuild it with "
                    f"tools/preprocess_data.py and this one")
        if sft is not None and rank0:
            refuse_no_loss_tokens([SFTDataset(p) for p in prefixes], *sft)
    except ValueError as err:
        problem = str(err)
    if distributed:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise InputError(problem)


def max_token_ids(prefixes: Sequence[str], cache_dir: str) -> List[int]:
    """The largest token id of each prefix, the same on every rank. Rank 0 reads the cache;
    the pass over a ``.bin`` not cached is shared, each rank scanning its slice, so big data
    is read once in all and no rank waits on one that reads it all alone."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [max_token_id(p, cache_dir) for p in prefixes]
    rank, world = dist.get_rank(), dist.get_world_size()
    box = [[cached_max_token_id(p, cache_dir) for p in prefixes] if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    known = box[0]
    for i, prefix in enumerate(prefixes):
        if known[i] is None:
            parts: List[Optional[int]] = [None] * world
            dist.all_gather_object(parts, scan_max_token_id(prefix, (rank, world)))
            known[i] = max(parts)
            if rank == 0:
                store_max_token_id(prefix, cache_dir, known[i])
    return known
