"""Small helpers shared by the tokenizers: ids as packed arrays, and file identity.

Kept apart from ``build`` so that ``megatron_lm`` (which ``build``
dispatches to) can use them without an import circle. numpy and the standard library only.
"""

from __future__ import annotations

import hashlib
from itertools import chain
from typing import Sequence

import numpy


def pack(docs: Sequence[Sequence[int]]) -> tuple[numpy.ndarray, numpy.ndarray]:
    """Lists of ids as two int32 arrays: every id, concatenated, and each list's length."""
    lengths = numpy.fromiter(map(len, docs), numpy.int32, count=len(docs))
    ids = numpy.fromiter(chain.from_iterable(docs), numpy.int32, count=int(lengths.sum()))
    return ids, lengths


def file_sha256(path: str) -> str:
    """Hex SHA-256 of a file, read in 1 MiB blocks (identifies tokenizer and model files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
