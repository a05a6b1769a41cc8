"""megatron-core's ``.bin``/``.idx`` format, written with numpy alone, in flat memory and with
an atomic commit.

:class:`IndexedDatasetOutput` writes one ``<prefix>.bin``/``.idx`` pair under temp names and
renames it only when complete; :class:`IndexedDatasetWriter` writes the bytes, keeping the
index in spill files rather than lists. Used by the preprocessing pipeline
(:mod:`megatron_jreg.data.preprocess.pipeline`); the dataset readers parse the header with
:func:`read_header`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct

import numpy

from megatron_jreg.atomic_write import temp_marker

# The format of megatron-core 0.16.1 (``indexed_dataset.py``; a test pins these bytes to its
# ``IndexedDatasetBuilder`` and reads them back with its ``IndexedDataset``). Written here, not
# through megatron-core, because importing megatron-core takes seconds.
# - ``.bin``: every sequence's token ids, concatenated, in the dataset's dtype.
# - ``.idx``: ``MAGIC``, then little-endian version (Q, always 1), dtype code (B), sequence count
#   (Q) and document boundary count (Q): ``HEADER_BYTES`` in all. Then int32 tokens per
#   sequence, int64 byte offset of each sequence in the ``.bin``, and int64 document
#   boundaries: ``[0, end of document 1, ...]`` in sequences.
MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<QBQQ")  # version, dtype code, sequence count, boundary count
HEADER_BYTES = len(MAGIC) + _HEADER.size
# megatron-core's DType codes (a test pins them).
DTYPE_CODES = {1: numpy.uint8, 2: numpy.int8, 3: numpy.int16, 4: numpy.int32, 5: numpy.int64,
               6: numpy.float64, 7: numpy.float32, 8: numpy.uint16}
_CODE_OF = {numpy.dtype(dtype): code for code, dtype in DTYPE_CODES.items()}

_BLOCK_ITEMS = 1 << 20  # items per read-back block at finalize: 8 MB of int64


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def read_header(path: str) -> tuple[int, int, int, int] | None:
    """(version, dtype code, sequences, document boundaries) of an ``.idx``; None when the
    file is too short or lacks the magic."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
        return None
    return _HEADER.unpack(head[len(MAGIC):])


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
    """Close ``f`` and drop the bytes it still buffers, writing nothing (cleanup on a full disk
    must not fail again flushing them before anything is deleted)."""
    raw = getattr(f, "raw", None)
    if raw is not None:
        raw.close()  # a buffered file whose raw file is closed closes without flushing
        f.close()
        return
    with contextlib.suppress(OSError):  # not a buffered file: it may flush; it is deleted next
        f.close()


class _SpillArray:
    """An append-only array of one dtype kept in a temp file instead of memory."""

    def __init__(self, path: str, dtype) -> None:
        self.path = path
        self.dtype = numpy.dtype(dtype)
        self._file = open(path, "w+b")
        self.count = 0

    def extend(self, values) -> None:
        values = numpy.asarray(values, dtype=self.dtype)
        if values.size:
            with _writing(self.path):
                self._file.write(values.tobytes())
            self.count += values.size

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


def _read_index(path: str, dtype) -> tuple[numpy.ndarray, numpy.ndarray]:
    """(sequence lengths, document boundaries) of an ``.idx`` of ``dtype``, mapped, not read."""
    header = read_header(path)
    if header is None or header[0] != VERSION or header[1] not in DTYPE_CODES:
        raise ValueError(f"add_index: {path} is not a megatron-core index file")
    _, code, sequences, documents = header
    if numpy.dtype(DTYPE_CODES[code]) != numpy.dtype(dtype):
        raise ValueError(
            f"add_index: {path!r} holds {numpy.dtype(DTYPE_CODES[code]).name} tokens, this "
            f"dataset {numpy.dtype(dtype).name}; rebuild it with the same tokenizer"
        )

    def mapped(kind, count, offset):
        # numpy cannot map zero bytes
        return numpy.memmap(path, kind, "r", offset, (count,)) if count else numpy.zeros(0, kind)

    lengths = mapped(numpy.int32, sequences, HEADER_BYTES)
    boundaries = mapped(numpy.int64, documents, HEADER_BYTES + sequences * 12)
    return lengths, boundaries


class IndexedDatasetWriter:
    """One ``.bin`` written as it comes, and its ``.idx`` at ``finalize``; the index grows in
    spill files (``spill_prefix``.*), not in lists: a billion-token corpus has gigabytes of
    sequence lengths and document boundaries.

    The bytes are those of megatron-core's ``IndexedDatasetBuilder`` given the same
    sequences (``add_item``/``end_document``, ``add_document``, ``add_index``).
    """

    def __init__(self, bin_file: str, dtype, spill_prefix: str) -> None:
        self.bin_path = bin_file
        self.dtype = numpy.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"{self.dtype.name} is not a megatron-core token dtype")
        self.data_file = open(bin_file, "wb")
        self.sequence_lengths = _SpillArray(spill_prefix + ".lengths", numpy.int32)
        self.document_indices = _SpillArray(spill_prefix + ".documents", numpy.int64)
        self.document_indices.extend(numpy.zeros(1, numpy.int64))

    def add_encoded(self, tokens, sequence_lengths: numpy.ndarray,
                    sequences_per_document: numpy.ndarray | None = None) -> None:
        """Append documents: ``tokens`` (bytes or an array) already in this dataset's dtype,
        int32 ``sequence_lengths``, and ``sequences_per_document`` (None: one sequence each).
        """
        if memoryview(tokens).nbytes != int(sequence_lengths.sum()) * self.dtype.itemsize:
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

    def add_index(self, prefix: str) -> None:
        """Append a whole dataset of the same dtype (how partitions are merged)."""
        lengths, boundaries = _read_index(idx_path(prefix), self.dtype)
        offset = self.sequence_lengths.count
        for start in range(0, len(lengths), _BLOCK_ITEMS):
            self.sequence_lengths.extend(lengths[start:start + _BLOCK_ITEMS])
        for start in range(1, len(boundaries), _BLOCK_ITEMS):
            self.document_indices.extend(offset + boundaries[start:start + _BLOCK_ITEMS])
        del lengths, boundaries  # unmap before the next file
        with open(bin_path(prefix), "rb") as f, _writing(self.bin_path):
            shutil.copyfileobj(f, self.data_file, 1 << 22)

    def finalize(self, idx_file: str) -> None:
        with _writing(self.bin_path):
            self.data_file.close()
        with _writing(idx_file):
            f = open(idx_file, "wb")
            try:
                self._write_index(f)
            except BaseException:
                _close_without_writing(f)  # failed: the file is deleted, do not flush it
                raise
            f.close()
        self.discard_spill()

    def _write_index(self, f) -> None:
        lengths, boundaries = self.sequence_lengths, self.document_indices
        f.write(MAGIC + _HEADER.pack(VERSION, _CODE_OF[self.dtype], lengths.count,
                                     boundaries.count))
        for block in lengths.blocks():
            f.write(block.tobytes())
        offset = 0
        for block in lengths.blocks():  # byte offsets: the running sum of the lengths
            ends = numpy.cumsum(block, dtype=numpy.int64) * self.dtype.itemsize
            pointers = numpy.empty_like(ends)
            pointers[0] = offset
            pointers[1:] = offset + ends[:-1]
            offset += int(ends[-1])
            f.write(pointers.tobytes())
        for block in boundaries.blocks():
            f.write(block.tobytes())

    def discard_spill(self) -> None:
        """Delete the spill files and close the ``.bin`` (finalize does this; call it on
        failure too). Writes nothing: on a full disk that would fail again."""
        if not self.data_file.closed:
            _close_without_writing(self.data_file)
        self.sequence_lengths.discard()
        self.document_indices.discard()


class IndexedDatasetOutput:
    """One ``<prefix>.bin``/``.idx`` pair, written under temp names, renamed when complete."""

    def __init__(self, prefix: str, dtype) -> None:
        self.prefix = prefix
        tag = temp_marker()  # the lock names it: a takeover removes a killed run's temps
        self._bin_tmp = bin_path(prefix) + tag
        self._idx_tmp = idx_path(prefix) + tag
        self.writer = IndexedDatasetWriter(self._bin_tmp, dtype, prefix + tag)
        self._done = False

    def commit(self) -> None:
        """Finalize, then rename: a stale .idx goes first so no old/new mix is ever valid."""
        self.writer.finalize(self._idx_tmp)
        if os.path.exists(idx_path(self.prefix)):
            os.unlink(idx_path(self.prefix))
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._done = True

    def abort(self) -> None:
        """Remove every temp file, writing nothing; safe to call twice or after commit."""
        if self._done:
            return
        self.writer.discard_spill()
        for path in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(path):
                os.unlink(path)
        self._done = True
