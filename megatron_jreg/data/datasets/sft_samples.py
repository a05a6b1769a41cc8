"""Training samples over chat data (``preprocess_data.py --sft``): one conversation per
sample, padded to ``--seq-length``.

:class:`SFTSamples` gives each sample's tokens, labels, loss mask (the assistant tokens) and
token mask (the real tokens JREG counts). Padding, not packing: the padding comes after the one
conversation, so under the causal mask no token attends across conversations; its compute is
reported by :func:`padding_waste` when the trainer starts.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.errors import InputError


def split_ranges(num: int, split: str) -> List[range]:
    """Contiguous train/valid/test ranges of ``num`` conversations by ``--split`` weights
    (``969,30,1``), rounded as megatron-core rounds its document split."""
    weights = [float(w) for w in split.replace("/", ",").split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w / total * num)))
    shift = bounds[-1] - num
    bounds = [bounds[0]] + [b - shift for b in bounds[1:]]
    return [range(bounds[i], bounds[i + 1]) for i in range(3)]


class SFTSamples:
    """Samples ``0..num_samples-1`` over the conversations ``indices`` of ``datasets``
    (concatenated), each epoch in a new seeded order: sample ``i`` is conversation
    ``perm_e[i % n]`` with ``e = i // n``, ``perm_e`` the permutation of seed ``seed + e``."""

    def __init__(self, datasets: Sequence, indices: Sequence[int], seq_length: int,
                 num_samples: int, seed: int, pad_id: int) -> None:
        if not len(indices):
            raise InputError("the --split gives no conversations to this split; change --split "
                             "or add conversations")
        self.datasets = list(datasets)
        self.offsets = np.cumsum([0] + [len(d) for d in self.datasets])
        self.indices = np.asarray(indices, dtype=np.int64)
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.pad_id = pad_id
        self._perms: Dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def has_loss_token(self) -> bool:
        """Whether any conversation of this split has a loss token within --seq-length."""
        return has_loss_token(self.datasets, self.indices, self.seq_length)

    def _conversation(self, index: int) -> Dict[str, np.ndarray]:
        which = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.datasets[which][index - int(self.offsets[which])]

    def conversation_index(self, i: int) -> int:
        n = len(self.indices)
        epoch, pos = divmod(i, n)
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.RandomState((self.seed + epoch) % 2**32).permutation(n)
            self._perms = {epoch: perm}  # one epoch at a time: samples are read in order
        return int(self.indices[perm[pos]])

    def __getitem__(self, i: int) -> Dict[str, np.ndarray]:
        # a conversation of n tokens (cut to seq_length + 1 first) gives inputs t[:-1] and
        # labels t[1:]; the loss mask is the data's mask on the labels, so the model learns to
        # predict exactly the assistant tokens. Padding has loss mask 0 and token_mask False,
        # so JREG's displacement counts real tokens only.
        conv = self._conversation(self.conversation_index(i))
        s = self.seq_length
        tokens = np.asarray(conv["tokens"], dtype=np.int64)[: s + 1]
        mask = np.asarray(conv["loss_mask"], dtype=np.float32)[: s + 1]
        n = len(tokens) - 1  # predicted positions
        out_tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.float32)
        token_mask = np.zeros(s, dtype=bool)
        out_tokens[:n] = tokens[:-1]
        labels[:n] = tokens[1:]
        loss_mask[:n] = mask[1:]
        token_mask[:n] = True
        return {"tokens": out_tokens, "labels": labels, "loss_mask": loss_mask,
                "position_ids": np.arange(s, dtype=np.int64), "token_mask": token_mask}


def padding_waste(datasets: Sequence, indices: Sequence[int], seq_length: int) -> float:
    """The fraction of a padded epoch's token positions that are padding."""
    lengths = np.concatenate([np.asarray(d.lengths, dtype=np.int64) for d in datasets])[
        np.asarray(indices, dtype=np.int64)]
    used = np.minimum(lengths - 1, seq_length).clip(min=0)
    total = len(used) * seq_length
    return float(1.0 - used.sum() / total) if total else 0.0


def has_loss_token(datasets: Sequence, indices: Sequence[int], seq_length: int) -> bool:
    """Whether any of the conversations ``indices`` (over ``datasets`` concatenated) has a
    loss token within ``seq_length`` (a sample's labels are tokens ``1..seq_length``).
    Stops at the first that has one."""
    offsets = np.cumsum([0] + [len(d) for d in datasets])
    for index in indices:
        which = int(np.searchsorted(offsets, index, side="right")) - 1
        if datasets[which].loss_mask(index - int(offsets[which]))[1:seq_length + 1].any():
            return True
    return False


def refuse_no_loss_tokens(datasets: Sequence, split: str, seq_length: int) -> None:
    """Refuse a train split none of whose conversations has a loss token within
    ``seq_length`` (a sample's labels are tokens ``1..seq_length``): every step would train
    on nothing. One line, with the fix. Stops at the first conversation that has one."""
    total = sum(len(d) for d in datasets)
    train_range = split_ranges(total, split)[0]
    if not len(train_range) or has_loss_token(datasets, train_range, seq_length):
        return  # (no conversation at all: SFTSamples names that problem)
    raise InputError(
        f"--sft: none of the {len(train_range)} conversations of the train split has a loss "
        f"token (an assistant token) within --seq-length {seq_length}: every reply starts "
        f"later; raise --seq-length or shorten the prompts before preprocess_data.py --sft")


def build_sft_samples(prefixes: Sequence[str], split: str, seq_length: int, seed: int,
                      train_samples: int, valid_samples: int, pad_id: int):
    """(train, valid or None, padding waste of the train split) over ``prefixes``."""
    datasets = [SFTDataset(p) for p in prefixes]
    total = sum(len(d) for d in datasets)
    train_range, valid_range, _ = split_ranges(total, split)
    train = SFTSamples(datasets, train_range, seq_length, train_samples, seed, pad_id)
    valid = None
    if valid_samples and len(valid_range):
        # validation reads its fixed batches in one seeded order, like the pretraining path
        valid = SFTSamples(datasets, valid_range, seq_length, valid_samples, seed + 1, pad_id)
    return train, valid, padding_waste(datasets, train_range, seq_length)
