"""Megatron-LM's ``--dataloader-type cyclic`` sample order, as a view of a dataset.

``single`` (the default, Megatron-LM's MegatronPretrainingSampler) reads the train samples
in order: step after step, consecutive chunks of micro-batch x data-parallel samples, which
is what ``batches.rank_microbatches`` does with the dataset itself. ``cyclic``
(MegatronPretrainingRandomSampler with data sharding, Megatron-LM's default) gives each DP
rank its own bucket of the dataset and reads it in a random order drawn anew each epoch
from a generator seeded by the epoch number; this view maps the index that
``rank_microbatches`` asks for to the sample that sampler yields.
"""

from __future__ import annotations

import sys

import torch

from megatron_jreg.errors import InputError


class CyclicOrder:
    """``dataset`` read in Megatron-LM's cyclic order for a given micro-batch and DP size."""

    def __init__(self, dataset, micro_batch_size: int, dp_size: int):
        self.dataset = dataset
        self.mbs, self.dp = micro_batch_size, dp_size
        per_round = micro_batch_size * dp_size
        total = len(dataset)
        self.active = total - total % per_round  # whole rounds of the epoch
        self.bucket = total // per_round * micro_batch_size  # each DP rank's share
        if self.bucket == 0:
            raise InputError(f"the train split has {total} samples, fewer than one step's "
                             f"micro-batches ({per_round}); use --dataloader-type single or "
                             f"more data")
        self._epoch, self._perm = None, None

    def __len__(self) -> int:
        # rank_microbatches wraps indices at len(); this view runs over epochs itself, so it
        # must see the index as asked
        return sys.maxsize

    def _permutation(self, epoch: int):
        if epoch != self._epoch:
            generator = torch.Generator()
            generator.manual_seed(epoch)  # Megatron-LM seeds with the epoch only
            perm = torch.randperm(self.bucket, generator=generator).tolist()
            self._epoch, self._perm = epoch, perm
        return self._perm

    def __getitem__(self, index: int):
        per_round = self.mbs * self.dp
        start = index // per_round * per_round  # samples consumed before this micro-batch round
        rank, k = divmod(index % per_round, self.mbs)
        epoch, within = divmod(start, self.active)
        drawn = within // self.dp + k  # this rank's samples drawn so far this epoch
        return self.dataset[rank * self.bucket + self._permutation(epoch)[drawn]]
