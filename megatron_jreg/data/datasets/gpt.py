"""Train/valid/test GPT datasets over preprocessed ``.bin``/``.idx`` data, via megatron-core.

The trainer calls ``build_gpt_datasets``; everything goes through megatron-core's
``BlendedMegatronDatasetBuilder`` and ``GPTDataset``, so blends, splits and the index cache
behave exactly as in Megatron-LM. Each sample also carries ``token_mask`` (see
:func:`token_masked_gpt_dataset_class`): JREG's displacement counts real tokens only.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
from dataclasses import dataclass

from megatron_jreg.data.datasets.blend import parse_data_path
from megatron_jreg.data.datasets.index_cache import check_index_cache
from megatron_jreg.data.datasets.token_range import index_key
from megatron_jreg.errors import InputError

_SPLIT_HELP = "comma-separated train,valid,test weights, e.g. 969,30,1"
# megatron-core's .idx header: magic (9 bytes), version (Q), dtype code (B), sequence count
# (Q), document-boundary count (Q); then int32 lengths, int64 pointers, int64 boundaries.
_IDX_HEADER_BYTES = 34
_REBUILD = "rebuild the pair with tools/preprocess_data.py"


@dataclass(kw_only=True)
class GPTDataConfig:
    """Where the data is and how to cut it into samples (Megatron-LM flag names)."""

    data_path: list[str]
    """``--data-path``: prefixes, or weight/prefix pairs: ``0.7 a_text_document 0.3 b_...``."""
    split: str = "969,30,1"
    """``--split``: train,valid,test weights of each dataset's documents."""
    seq_length: int = 2048
    """``--seq-length``: tokens per sample (GPTDataset draws one more for the shifted labels)."""
    seed: int = 1234
    """``--seed``: shuffling of documents and samples."""
    cache_dir: str | None = None
    """``--data-cache-path``: where megatron-core caches sample indices; None means an
    ``index-cache`` directory beside the first dataset."""
    reset_position_ids: bool = False
    """Restart position ids after each EOD."""
    reset_attention_mask: bool = False
    """Block attention across EOD."""
    eod_mask_loss: bool = False
    """No loss at the positions whose input token is EOD (where the next document's first
    token is predicted from the end of the previous one); EOD as a target still counts."""
    num_dataset_builder_threads: int = 1

    def __post_init__(self) -> None:
        if not self.data_path:
            raise InputError("--data-path is empty; pass dataset prefixes from preprocess_data.py")
        if self.seq_length < 1:
            raise InputError(f"--seq-length must be at least 1, got {self.seq_length}")
        parts = self.split.replace("/", ",").split(",")
        # plain decimals only: megatron-core re-reads the string with that pattern (nan,
        # inf and exponents would be misread there or fail its assertions)
        if not all(re.fullmatch(r"\s*(\d+\.?\d*|\.\d+)\s*", p) for p in parts):
            raise InputError(
                f"--split {self.split!r} is not numbers (plain decimals); use {_SPLIT_HELP}")
        weights = [float(p) for p in parts]
        if len(weights) > 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
            raise InputError(f"--split {self.split!r} is invalid; use {_SPLIT_HELP}")
        self.blend()  # the --data-path weights, checked before any work

    def blend(self) -> tuple[list[str], list[float] | None]:
        """(prefixes, weights or None) of ``--data-path`` (``blend.parse_data_path``)."""
        prefixes, weights = parse_data_path(self.data_path)
        for prefix, weight in zip(prefixes, weights or ()):
            if not (math.isfinite(weight) and weight > 0):  # megatron-core asserts w > 0
                raise InputError(f"--data-path weight {weight} of {prefix!r}: every weight must be "
                                 "a finite number > 0 (drop a prefix to leave it out)")
        return prefixes, weights


def check_indexed_dataset(prefix: str) -> None:
    """Refuse a ``prefix.bin``/``.idx`` pair that megatron-core would misread.

    megatron-core trusts the ``.idx``: a ``.bin`` from another run trains on the wrong tokens
    (a bigger one), fails deep inside sampling naming no file (a shorter one), or trains fine
    (slightly short). Checked here: the ``.idx`` header and size, that the ``.bin`` holds
    exactly the tokens the ``.idx`` describes, and that there is at least one token. Reads a
    few numbers, not the dataset. Raises ValueError: one line naming the files and the fix.
    """
    import numpy
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise InputError(f"--data-path {prefix!r}: {path} does not exist; {_REBUILD}")
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
    if len(head) < _IDX_HEADER_BYTES or head[:len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise InputError(f"{idx_path} is not a megatron-core index file; {_REBUILD}")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[len(_INDEX_HEADER):])
    try:
        itemsize = DType.size(code)
    except ValueError:
        raise InputError(f"{idx_path}: unknown token dtype code {code}; {_REBUILD}") from None
    idx_size = os.path.getsize(idx_path)
    expected_idx = _IDX_HEADER_BYTES + sequences * (4 + 8) + documents * 8
    # version 1 is the only one; multimodal indices append one mode byte per sequence
    if version != 1 or idx_size not in (expected_idx, expected_idx + sequences):
        raise InputError(
            f"{idx_path} is {idx_size} bytes, not the {expected_idx} its header describes "
            f"(version {version}, {sequences} sequences): it is truncated or damaged; {_REBUILD}"
        )
    tokens = 0
    if sequences:
        # Pointers are cumulative byte offsets, so the last sequence's end is the token count:
        # two numbers instead of a pass over every length.
        offset = _IDX_HEADER_BYTES + (sequences - 1) * 4
        last_length = int(numpy.fromfile(idx_path, numpy.int32, 1, offset=offset)[0])
        offset = _IDX_HEADER_BYTES + sequences * 4 + (sequences - 1) * 8
        last_pointer = int(numpy.fromfile(idx_path, numpy.int64, 1, offset=offset)[0])
        tokens = last_pointer // itemsize + last_length
    if tokens == 0:
        raise InputError(
            f"--data-path {prefix!r}: the dataset holds no tokens ({idx_path} lists "
            f"{sequences} sequences); preprocess a corpus with documents in it"
        )
    bin_size = os.path.getsize(bin_path)
    if bin_size != tokens * itemsize:
        raise InputError(
            f"{bin_path} is {bin_size} bytes but {idx_path} describes {tokens} tokens of "
            f"{itemsize} bytes ({tokens * itemsize} bytes): the two files come from different "
            f"runs or one is damaged; {_REBUILD}"
        )


def build_gpt_datasets(
    config: GPTDataConfig,
    tokenizer,
    train_samples: int | None,
    valid_samples: int | None = None,
    test_samples: int | None = None,
):
    """(train, valid, test) datasets; a split with zero weight or size gives None.

    ``tokenizer`` is a ``megatron_jreg.data.tokenizers.build`` tokenizer (GPTDataset reads its
    ``eod``, ``vocab_size`` and ``unique_identifiers``). Sample counts of None mean one epoch
    for an unweighted blend; for a weighted blend (megatron-core needs counts there) a
    validation or test count of None or 0 leaves that split out.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefixes, weights = config.blend()
    for prefix in prefixes:
        if not IndexedDataset.exists(prefix):
            raise FileNotFoundError(
                f"--data-path {prefix!r}: no {prefix}.bin/.idx pair; make it with "
                f"tools/preprocess_data.py --output-prefix (the prefix ends in _text_document)"
            )
        check_indexed_dataset(prefix)  # before megatron-core opens (and trusts) the pair
    cache_dir = config.cache_dir or os.path.join(
        os.path.dirname(os.path.abspath(prefixes[0])), "index-cache"
    )
    os.makedirs(cache_dir, exist_ok=True)
    check_index_cache(cache_dir)  # before megatron-core's numpy.load(allow_pickle=True) of it
    gpt_config = GPTDatasetConfig(
        random_seed=config.seed,
        sequence_length=config.seq_length,
        blend=(prefixes, weights),
        split=config.split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=config.reset_position_ids,
        reset_attention_mask=config.reset_attention_mask,
        eod_mask_loss=config.eod_mask_loss,
        num_dataset_builder_threads=config.num_dataset_builder_threads,
        # Megatron-LM builds a [1, s, s] mask per sample unless
        # --no-create-attention-mask-in-dataloader; nothing here reads it (training/step.py
        # builds the causal mask itself) and it costs 5 s^2 bytes (268 MB at s=8192, an
        # out-of-memory traceback at s=200000), so it is never built
        create_attention_mask=False,
    )
    # megatron-core keys its index cache by path and config: the .idx digests make a prefix
    # rebuilt with other documents get new indices, never the stale ones (token_range)
    gpt_config.data_content = {p: index_key(p) for p in prefixes}
    sizes = [train_samples, valid_samples, test_samples]
    if weights is not None:
        # megatron-core needs a size for every split of a weighted blend (a None size
        # asserts). A split not asked for (None or 0) is not built: its range is dropped
        # (the others keep theirs as --split puts them), which also spares a split with no
        # documents, on which megatron-core's epoch count would loop forever.
        for i in (1, 2):
            if not sizes[i]:
                gpt_config.split_matrix[i] = None
                sizes[i] = 0
    if gpt_config.split_matrix[0] is None:  # megatron-core would build no train dataset
        raise InputError(f"--split {config.split} gives the train split no weight: the first of "
                         "the three weights is the train split's (e.g. --split 969,30,1)")
    for prefix in prefixes:
        if weights is not None or len(prefixes) == 1:  # an unweighted blend builds one epoch
            refuse_empty_splits(prefix, gpt_config.split_matrix, sizes, config.split,
                                sized=weights is not None)
    builder = BlendedMegatronDatasetBuilder(
        token_masked_gpt_dataset_class(),
        sizes,
        lambda: True,  # every rank builds (or loads cached) indices; megatron syncs if needed
        gpt_config,
    )
    with _single_rank_group_if_needed(), _index_cache_lock(cache_dir):
        train, valid, test = builder.build()
    return train, valid, test


def refuse_empty_splits(prefix: str, split_matrix, sizes, split: str, sized: bool) -> None:
    """Refuse a split that megatron-core would build with a sample count from no tokens:
    ``GPTDataset._get_num_epochs`` adds epochs of zero tokens until they hold the count,
    forever. ``split_matrix`` and the per-split ``sizes`` are the builder's; ``sized``: a
    weighted blend, where every built split gets a count. One line naming the split and
    the prefix, and the fix."""
    import numpy

    sequences = struct.unpack("<QBQQ", _idx_head(prefix))[2]
    lengths = numpy.fromfile(prefix + ".idx", numpy.int32, sequences, offset=_IDX_HEADER_BYTES)
    for name, bounds, size in zip(("train", "validation", "test"), split_matrix, sizes):
        if bounds is None or (size is None and not sized):
            continue
        # megatron-core's own rounding of the split into documents
        first, end = int(round(bounds[0] * sequences)), int(round(bounds[1] * sequences))
        if int(lengths[first:end].sum(dtype=numpy.int64)) == 0:
            fix = " (or --eval-interval 0 for no validation)" if name == "validation" else ""
            raise InputError(
                f"--split {split} gives the {name} split {end - first} of the {sequences} "
                f"documents of --data-path {prefix!r}, and no tokens: give it more weight in "
                f"--split or add documents{fix}")


def _idx_head(prefix: str) -> bytes:
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER

    with open(prefix + ".idx", "rb") as f:
        return f.read(_IDX_HEADER_BYTES)[len(_INDEX_HEADER):]


@contextlib.contextmanager
def _index_cache_lock(cache_dir):
    """megatron-core 0.16.1 writes the index cache in place (``numpy.save`` to the final
    names) on rank 0, and a run takes the cache as complete once its four files exist: a
    second run on the same data and settings (the baseline and JREG arms started together)
    could read a file still being written. Rank 0 of each run holds an exclusive lock on
    the cache directory while it builds or loads; the other ranks read only after their
    rank 0 is done (megatron-core's barrier). A directory that cannot take the lock file
    (read-only, with a complete cache) is read without it."""
    import fcntl

    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        yield
        return
    try:
        lock = open(os.path.join(cache_dir, ".lock"), "a")
    except OSError:
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _single_rank_group_if_needed():
    """A one-rank gloo group while building, when no process group exists.

    megatron-core 0.16.1's BlendedDataset calls ``torch.distributed.get_rank()`` without
    checking ``is_initialized()`` (GPTDataset does check), so a weighted blend fails in a
    plain single process (tests, notebooks, tools). An in-memory store needs no network.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


_TOKEN_MASKED_CLASS = None


def token_masked_gpt_dataset_class():
    """megatron-core's ``GPTDataset`` whose samples also carry ``token_mask`` ([s] bool).

    ``token_mask`` is False exactly at the positions whose input token is padding that
    GPTDataset appended (a sample that runs past the end of the data). GPTDataset maps
    padding to token id 0 and marks it only through ``loss_mask``, which also drops the
    last real token (its target is padding) and, under ``eod_mask_loss``, the positions
    whose input token is EOD; so the padding is read from the sample before that mapping:
    the trailing run of the pad id (padding is only ever appended). Real tokens, EOD
    included, are counted.
    """
    global _TOKEN_MASKED_CLASS
    if _TOKEN_MASKED_CLASS is not None:
        return _TOKEN_MASKED_CLASS
    import numpy
    import torch
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class TokenMaskedGPTDataset(GPTDataset):
        def __init__(self, *args, **kwargs):
            config = kwargs["config"] if "config" in kwargs else args[-1]
            if not hasattr(config, "data_content"):  # a config not from build_gpt_datasets
                config.data_content = {}
            super().__init__(*args, **kwargs)

        def _query_document_sample_shuffle_indices(self, idx):
            text, document_ids = super()._query_document_sample_shuffle_indices(idx)
            pad = text == self._pad_token_id
            # the real prefix: everything before the trailing run of padding
            trailing = len(text) if pad.all() else int(numpy.argmin(pad[::-1]))
            self._real_tokens = len(text) - trailing
            return text, document_ids

        def __getitem__(self, idx):
            sample = super().__getitem__(idx)
            mask = torch.zeros(sample["tokens"].shape[0], dtype=torch.bool)
            mask[:self._real_tokens] = True
            sample["token_mask"] = mask
            return sample

    # megatron keys its sample-index cache by the class name: keep GPTDataset's, so the
    # sample order is the one Megatron-LM builds for the same data...
    TokenMaskedGPTDataset.__name__ = TokenMaskedGPTDataset.__qualname__ = "GPTDataset"
    # ...but add the content of the data to its key (build_gpt_datasets sets data_content)
    TokenMaskedGPTDataset._key_config_attributes = staticmethod(
        lambda: GPTDataset._key_config_attributes() + ["data_content"])
    _TOKEN_MASKED_CLASS = TokenMaskedGPTDataset
    return _TOKEN_MASKED_CLASS
