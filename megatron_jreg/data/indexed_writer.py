"""Writing megatron-core ``.bin``/``.idx`` pairs with flat memory and an atomic commit.

``StreamingIndexedDatasetBuilder`` is megatron-core's ``IndexedDatasetBuilder`` with its
Python lists of sequence lengths and document indices moved to temp files, and its
finalize streaming them out: stock finalize builds a Python list of every sequence
pointer, which for a billion-token corpus is gigabytes. The files it writes are
byte-identical to the stock builder's (tests pin this).

``IndexedDatasetOutput`` writes under temp names and renames only a complete pair, so an
interrupted run never leaves a ``.bin``/``.idx`` pair that looks valid.

Every OSError raised while writing names the file (Python's buffered writes do not), so a
full disk can be reported as "no space left writing <file>". Cleanup only closes and
deletes: flushing buffered bytes on a full disk would fail again before anything is deleted.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
from typing import Type

import numpy
import torch
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDatasetBuilder,
    _IndexReader,
    _IndexWriter,
    get_bin_path,
    get_idx_path,
)

_BLOCK_ITEMS = 1 << 20  # items per read-back block at finalize: 8 MB of int64


@contextlib.contextmanager
def _writing(path: str):
    """Give an OSError from writing ``path`` the file name it lacks (buffered writes have none)."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, path) from None


def _close_without_writing(f) -> None:
    """Close ``f`` and drop the bytes it still buffers, writing nothing."""
    raw = getattr(f, "raw", None)
    if raw is not None:
        raw.close()  # a buffered file whose raw file is closed closes without flushing
        f.close()
        return
    with contextlib.suppress(OSError):  # not a buffered file: it may flush; it is deleted next
        f.close()


class _SpillArray:
    """An append-only array of one dtype kept in a temp file instead of memory."""

    def __init__(self, path: str, dtype: Type[numpy.number]) -> None:
        self.path = path
        self.dtype = numpy.dtype(dtype)
        self._file = open(path, "w+b")
        self.count = 0
        self.last = 0

    def extend(self, values: numpy.ndarray) -> None:
        values = numpy.asarray(values, dtype=self.dtype)
        if values.size:
            with _writing(self.path):
                self._file.write(values.tobytes())
            self.count += values.size
            self.last = int(values[-1])

    def blocks(self):
        """The stored values, in order, a block at a time."""
        with _writing(self.path):
            self._file.flush()
        self._file.seek(0)
        itemsize = self.dtype.itemsize
        while True:
            raw = self._file.read(_BLOCK_ITEMS * itemsize)
            if not raw:
                return
            yield numpy.frombuffer(raw, dtype=self.dtype)

    def discard(self) -> None:
        """Close and delete; a spill file is only ever scratch space."""
        if not self._file.closed:
            _close_without_writing(self._file)
        if os.path.exists(self.path):
            os.unlink(self.path)


class _StreamingIndexWriter(_IndexWriter):
    """megatron-core's index writer (header and dtype code), fed from spill files."""

    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is None:
            return super().__exit__(exc_type, exc_val, exc_tb)
        _close_without_writing(self.idx_writer)  # failed: the file is deleted, do not flush it
        return None

    def write_spilled(self, lengths: _SpillArray, document_indices: _SpillArray) -> None:
        # Same layout as _IndexWriter.write: counts, lengths, pointers, document indices.
        self.idx_writer.write(struct.pack("<Q", lengths.count))
        self.idx_writer.write(struct.pack("<Q", document_indices.count))
        for block in lengths.blocks():
            self.idx_writer.write(block.tobytes())
        itemsize = DType.size(self.dtype)
        offset = 0
        for block in lengths.blocks():
            ends = numpy.cumsum(block, dtype=numpy.int64) * itemsize
            pointers = numpy.empty_like(ends)
            pointers[0] = offset
            pointers[1:] = offset + ends[:-1]
            offset += int(ends[-1])
            self.idx_writer.write(pointers.tobytes())
        for block in document_indices.blocks():
            self.idx_writer.write(block.tobytes())


class StreamingIndexedDatasetBuilder(IndexedDatasetBuilder):
    """``IndexedDatasetBuilder`` whose index grows on disk (``spill_prefix``.*), not in lists.

    Supports the stock API (``add_item``, ``add_document``, ``end_document``, ``add_index``,
    ``finalize``) plus ``add_encoded`` for a worker's packed batch of documents.
    """

    def __init__(self, bin_path: str, dtype: Type[numpy.number], spill_prefix: str) -> None:
        super().__init__(bin_path, dtype=dtype, multimodal=False)
        self.bin_path = bin_path
        self.sequence_lengths = _SpillArray(spill_prefix + ".lengths", numpy.int32)
        self.document_indices = _SpillArray(spill_prefix + ".documents", numpy.int64)
        self.document_indices.extend(numpy.zeros(1, numpy.int64))
        self._itemsize = numpy.dtype(dtype).itemsize

    def add_item(self, tensor: torch.Tensor, mode: int = 0) -> None:
        array = numpy.asarray(tensor.numpy(), dtype=self.dtype)
        with _writing(self.bin_path):
            self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(numpy.array([array.size], numpy.int32))

    def add_document(self, tensor, lengths, modes=None) -> None:
        array = numpy.asarray(tensor, dtype=self.dtype)
        with _writing(self.bin_path):
            self.data_file.write(array.tobytes(order="C"))
        self.sequence_lengths.extend(numpy.asarray(lengths, numpy.int32))
        self.end_document()

    def end_document(self) -> None:
        self.document_indices.extend(numpy.array([self.sequence_lengths.count], numpy.int64))

    def add_encoded(
        self,
        tokens: bytes,
        sequence_lengths: numpy.ndarray,
        sequences_per_document: numpy.ndarray | None = None,
    ) -> None:
        """Append documents already packed in this builder's dtype.

        ``sequences_per_document`` None means one sequence per document.
        """
        if len(tokens) != int(sequence_lengths.sum()) * self._itemsize:
            raise ValueError("add_encoded: token bytes do not match the sequence lengths")
        with _writing(self.bin_path):
            self.data_file.write(tokens)
        start = self.sequence_lengths.count
        self.sequence_lengths.extend(sequence_lengths)
        if sequences_per_document is None:
            ends = start + numpy.arange(1, len(sequence_lengths) + 1, dtype=numpy.int64)
        else:
            ends = start + numpy.cumsum(sequences_per_document, dtype=numpy.int64)
        self.document_indices.extend(ends)

    def add_index(self, path_prefix: str) -> None:
        index = _IndexReader(get_idx_path(path_prefix), multimodal=False)
        if index.dtype != self.dtype:
            raise ValueError(
                f"add_index: {path_prefix!r} holds {index.dtype.__name__} tokens, this dataset "
                f"{numpy.dtype(self.dtype).name}; rebuild it with the same tokenizer"
            )
        offset = self.sequence_lengths.count
        self.sequence_lengths.extend(index.sequence_lengths)
        self.document_indices.extend(offset + index.document_indices[1:])
        del index
        with open(get_bin_path(path_prefix), "rb") as f, _writing(self.bin_path):
            shutil.copyfileobj(f, self.data_file, 1 << 22)

    def finalize(self, idx_path: str) -> None:
        with _writing(self.bin_path):
            self.data_file.close()
        with _writing(idx_path), _StreamingIndexWriter(idx_path, self.dtype) as writer:
            writer.write_spilled(self.sequence_lengths, self.document_indices)
        self.discard_spill()

    def discard_spill(self) -> None:
        """Delete the spill files and close the ``.bin`` (finalize does this; call it on
        failure too). Writes nothing: on a full disk that would fail again."""
        if not self.data_file.closed:
            _close_without_writing(self.data_file)
        self.sequence_lengths.discard()
        self.document_indices.discard()


class IndexedDatasetOutput:
    """One ``<prefix>.bin``/``.idx`` pair, written under temp names, renamed when complete."""

    def __init__(self, prefix: str, dtype: Type[numpy.number]) -> None:
        self.prefix = prefix
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = get_bin_path(prefix) + tag
        self._idx_tmp = get_idx_path(prefix) + tag
        self.builder = StreamingIndexedDatasetBuilder(self._bin_tmp, dtype, prefix + tag)
        self._done = False

    def commit(self) -> None:
        """Finalize, then rename: a stale .idx goes first so no old/new mix is ever valid."""
        self.builder.finalize(self._idx_tmp)
        idx_path, bin_path = get_idx_path(self.prefix), get_bin_path(self.prefix)
        if os.path.exists(idx_path):
            os.unlink(idx_path)
        os.replace(self._bin_tmp, bin_path)
        os.replace(self._idx_tmp, idx_path)
        self._done = True

    def abort(self) -> None:
        """Remove every temp file, writing nothing; safe to call twice or after commit."""
        if self._done:
            return
        self.builder.discard_spill()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.unlink(path)
        self._done = True
