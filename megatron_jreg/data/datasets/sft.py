"""``SFTDataset``: an SFT dataset as ``tools/preprocess_data.py --sft`` writes it, read back.

The files (``P.bin``/``.idx`` tokens, ``P_loss_mask.bin``/``.idx`` loss masks, ``P.json``
metadata, for ``P = OUT_sft_document``) are described in ``preprocess.sft_files``.

The reader uses numpy on the format ``preprocess.writer`` documents, not megatron-core:
importing it costs seconds and it cannot tell a mask that does not belong to its tokens.
"""

from __future__ import annotations

import json
import os

import numpy

from megatron_jreg.data.preprocess.sft_files import FORMAT, MASK_SUFFIX, metadata_path
from megatron_jreg.data.preprocess.writer import DTYPE_CODES, HEADER_BYTES, VERSION, read_header
from megatron_jreg.errors import InputError

_REBUILD = "rebuild it with tools/preprocess_data.py --sft"


def _hint(prefix: str) -> str:
    if os.path.isfile(prefix + "_sft_document.idx"):
        return f"; pass the dataset prefix {prefix}_sft_document"
    return f"; {_REBUILD}"


class _Index:
    """One ``.bin``/``.idx`` pair: its dtype, sequence lengths and byte pointers, checked."""

    def __init__(self, prefix: str) -> None:
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        header = read_header(idx_path)
        if header is None:
            raise InputError(f"{idx_path} is not a megatron-core index file; {_REBUILD}")
        version, code, sequences, documents = header
        expected = HEADER_BYTES + sequences * 12 + documents * 8
        if version != VERSION or code not in DTYPE_CODES or os.path.getsize(idx_path) != expected:
            raise InputError(f"{idx_path} is truncated or damaged (version {version}, dtype "
                             f"code {code}, {sequences} sequences); {_REBUILD}")
        self.dtype = numpy.dtype(DTYPE_CODES[code])
        self.lengths = numpy.fromfile(idx_path, numpy.int32, sequences, offset=HEADER_BYTES)
        self.pointers = numpy.fromfile(idx_path, numpy.int64, sequences,
                                       offset=HEADER_BYTES + sequences * 4)
        self.tokens = int(self.lengths.sum(dtype=numpy.int64))
        size = os.path.getsize(bin_path)
        if size != self.tokens * self.dtype.itemsize:
            raise InputError(
                f"{bin_path} is {size} bytes but {idx_path} describes {self.tokens} tokens of "
                f"{self.dtype.itemsize} bytes: the two files come from different runs; "
                f"{_REBUILD}")
        # numpy cannot map an empty file; an empty dataset needs no mapping
        self.data = (numpy.memmap(bin_path, self.dtype, mode="r") if size
                     else numpy.zeros(0, self.dtype))

    def sequence(self, i: int) -> numpy.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.data[start:start + int(self.lengths[i])]


class SFTDataset:
    """Conversations of one SFT dataset: ``ds[i]`` is ``{"tokens", "loss_mask"}``, both int64
    arrays of one length. ``prefix`` is ``OUT_sft_document`` for ``--output-prefix OUT``.

    Raises InputError (one line, naming the file and the fix) for a missing file, a mask
    that does not fit its tokens, or metadata from another run.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        mask_prefix = prefix + MASK_SUFFIX
        for path in (prefix + ".bin", prefix + ".idx", mask_prefix + ".bin",
                     mask_prefix + ".idx", metadata_path(prefix)):
            if not os.path.isfile(path):
                raise InputError(f"SFT data {prefix!r}: {path} does not exist{_hint(prefix)}")
        self.metadata = self._read_metadata()
        self._tokens = _Index(prefix)
        self._mask = _Index(mask_prefix)
        if self._mask.dtype != numpy.uint8:
            raise InputError(f"{mask_prefix}.idx holds {self._mask.dtype} values, not a uint8 "
                             f"loss mask; {_REBUILD}")
        if not numpy.array_equal(self._tokens.lengths, self._mask.lengths):
            raise InputError(
                f"SFT data {prefix!r}: the loss mask's sequence lengths differ from the tokens' "
                f"({len(self._mask.lengths)} vs {len(self._tokens.lengths)} sequences): the "
                f"files come from different runs; {_REBUILD}")
        counts = self.metadata.get("counts", {})
        found = {"conversations": len(self), "tokens": self._tokens.tokens}
        for key, value in found.items():
            if counts.get(key) != value:
                raise InputError(
                    f"{metadata_path(prefix)} lists {counts.get(key)} {key} but the data holds "
                    f"{value}: the files come from different runs; {_REBUILD}")

    def _read_metadata(self) -> dict:
        path = metadata_path(self.prefix)
        try:
            with open(path, encoding="utf-8") as f:
                metadata = json.load(f)
        except ValueError as e:
            raise InputError(f"{path} is not valid JSON ({e}); {_REBUILD}") from None
        if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
            raise InputError(f"{path} is not the metadata of preprocess_data.py --sft "
                             f"(format {FORMAT!r}); {_REBUILD}")
        return metadata

    def __len__(self) -> int:
        return len(self._tokens.lengths)

    def __getitem__(self, i: int) -> dict[str, numpy.ndarray]:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"conversation {i} is out of range for {n} conversations")
        i %= n
        # copies, as plain arrays: a sample outlives nothing of the file mapping
        return {"tokens": numpy.array(self._tokens.sequence(i), dtype=numpy.int64),
                "loss_mask": numpy.array(self._mask.sequence(i), dtype=numpy.int64)}

    def loss_mask(self, i: int) -> numpy.ndarray:
        """Conversation ``i``'s loss mask (uint8), a view of the file: no copy."""
        return self._mask.sequence(i)

    @property
    def lengths(self) -> numpy.ndarray:
        """Tokens per conversation (int32)."""
        return self._tokens.lengths

    @property
    def chat_template(self) -> str | None:
        """The jinja text the conversations were rendered with."""
        return self.metadata.get("chat_template")
