"""Small helpers shared by the tokenizers: ids as packed arrays, and file identity.

Kept apart from ``build`` so that ``megatron_lm`` (which ``build``
dispatches to) can use them without an import circle. numpy and the standard library only.
"""

from __future__ import annotations

import hashlib
import re
from itertools import chain
from typing import Iterator, Sequence

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


# -- long texts ---------------------------------------------------------------------------
# A text longer than this is encoded piece by piece where its tokenizer allows (pieces of
# about this many characters), so its memory is the output array, not the library's
# per-token structures for the whole text (50-110 bytes per input byte for sentencepiece and
# Hugging Face tokenizers).
LONG_TEXT_CHARS = 1 << 18

# A single ASCII space between ASCII letters or digits: where the tokenizers that allow
# cutting (see ``space_cuts``) start a new word whatever comes before.
_SPACE_BETWEEN_WORDS = re.compile(r"(?<=[A-Za-z0-9]) (?=[A-Za-z0-9])")


def space_cuts(text: str, keep_space: bool, piece_chars: int = LONG_TEXT_CHARS) -> Iterator[str]:
    """``text`` in pieces of at least ``piece_chars`` characters, cut only at a single space
    between ASCII letters or digits; the piece after a cut starts with that space
    (``keep_space``) or just after it. A text with no such space stays whole."""
    start = 0
    while len(text) - start > piece_chars:
        match = _SPACE_BETWEEN_WORDS.search(text, start + piece_chars)
        if match is None:
            break
        yield text[start:match.start()]
        start = match.start() if keep_space else match.end()
    yield text[start:] if start else text


class TokenBuffer:
    """An array that grows in place (``realloc``, which moves no pages for big arrays), so
    appending a long text's pieces never holds them twice."""

    def __init__(self, dtype, capacity: int = 1 << 16) -> None:
        self._array = numpy.empty(capacity, dtype)
        self.size = 0

    def append(self, ids) -> None:
        ids = numpy.asarray(ids)
        need = self.size + ids.size
        if need > self._array.size:
            # no view of the array exists outside this object, so resizing it is safe
            self._array.resize(max(need, 2 * self._array.size), refcheck=False)
        self._array[self.size:need] = ids  # casts to the buffer's dtype
        self.size = need

    def finish(self) -> numpy.ndarray:
        """The ids appended, as an array of exactly that length; the buffer is done."""
        array, self._array = self._array, None
        array.resize(self.size, refcheck=False)
        return array


def pack_texts(texts: Sequence[str], encode_batch, encode_long, dtype=numpy.int32,
               eod: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(ids of every text, each followed by ``eod`` when given, in ``dtype``; ids per text).

    ``encode_batch(texts)`` gives (ids, lengths) for ordinary texts in one library call;
    ``encode_long(text)`` yields a long text's ids a piece at a time (``space_cuts``).
    A batch holding a text over ``LONG_TEXT_CHARS`` is encoded one text at a time.
    """
    if all(len(text) <= LONG_TEXT_CHARS for text in texts):
        ids, lengths = encode_batch(texts)
        ids = ids.astype(dtype, copy=False)
        if eod is not None:
            ends = numpy.cumsum(lengths, dtype=numpy.int64)
            ids = numpy.insert(ids, ends, numpy.array(eod, dtype))
            lengths = lengths + numpy.int32(1)
        return ids, lengths
    buffer = TokenBuffer(dtype)
    lengths = numpy.zeros(len(texts), numpy.int32)
    for i, text in enumerate(texts):
        start = buffer.size
        if len(text) <= LONG_TEXT_CHARS:
            buffer.append(encode_batch([text])[0])
        else:
            for piece in encode_long(text):
                buffer.append(piece)
        if eod is not None:
            buffer.append(numpy.array([eod]))
        lengths[i] = buffer.size - start
    return buffer.finish(), lengths
