"""Finding input files and reading them as line-aligned chunks, without whole-file reads.

A chunk is raw bytes ending at a line boundary (or a list of Parquet rows), tagged with the
number of its first line so workers' errors can be reported as ``file:line``; ``.gz`` and
``.zst`` files are decompressed by :mod:`megatron_jreg.data.preprocess.compressed`.
:func:`jsonl_records` reads a JSONL file line by line (``eval_jump --jsonl``).
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
from dataclasses import dataclass
from typing import BinaryIO, Iterator

from megatron_jreg.data.preprocess.compressed import CheckedReader, DamagedInputError
from megatron_jreg.errors import InputError

INPUT_FORMATS = ("jsonl", "text")
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TEXT_SUFFIXES = (".txt", ".text")
_COMPRESSIONS = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
_BLOCK = 1 << 20
# Bytes that are not UTF-8, as errors="surrogateescape" reads them.
_UNDECODED = re.compile("[\udc80-\udcff]")


class BadLineError(InputError):
    """A line that is not UTF-8 (``json_error`` None) or not JSON; ``line`` is 1-based."""

    def __init__(self, path: str, line: int, json_error: str | None = None) -> None:
        problem = "not UTF-8 text" if json_error is None else f"malformed JSON ({json_error})"
        super().__init__(f"{path}:{line}: {problem}")
        self.path, self.line, self.json_error = path, line, json_error


def utf8_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a UTF-8 text file, lazily; BadLineError names one that is not."""
    with open(path, encoding="utf-8", errors="surrogateescape") as f:  # bad bytes: U+DCxx
        for lineno, line in enumerate(f, start=1):
            if not line.isascii() and _UNDECODED.search(line):
                raise BadLineError(path, lineno)
            yield lineno, line


def jsonl_records(path: str) -> Iterator[tuple[int, object]]:
    """(line number, JSON value) of each non-blank line of a JSON-lines file, lazily."""
    for lineno, line in utf8_lines(path):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadLineError(path, lineno, e.msg) from None
            yield lineno, record


@dataclass(frozen=True)
class Segment:
    """A whole input file, or a line-aligned byte range of an uncompressed one."""

    path: str
    kind: str
    """``jsonl``, ``text`` or ``parquet``."""
    compression: str | None = None
    """None, ``gz`` or ``zst``; compressed files cannot be split into ranges."""
    start: int = 0
    end: int | None = None
    """Byte range [start, end); end None means to the end of the file."""
    first_line: int = 1
    """1-based number of the line (or Parquet row) at ``start``."""

    @property
    def splittable(self) -> bool:
        return self.compression is None and self.kind != "parquet"

    def size(self) -> int:
        end = os.path.getsize(self.path) if self.end is None else self.end
        return end - self.start

    def open_binary(self) -> BinaryIO:
        """The decompressed byte stream at ``start``; damaged data raises DamagedInputError."""
        if self.compression is not None:
            return io.BufferedReader(CheckedReader(self.path, self.compression), _BLOCK)
        f = open(self.path, "rb")
        f.seek(self.start)
        return f

    def open_text(self) -> io.TextIOWrapper:
        return io.TextIOWrapper(self.open_binary(), encoding="utf-8", newline="\n")


def _file_kind(path: str, input_format: str) -> tuple[str, str | None]:
    """(kind, compression) of one file, by its suffixes and ``--input-format``."""
    stem, ext = os.path.splitext(path)
    compression = _COMPRESSIONS.get(ext.lower())
    if compression is not None:
        ext = os.path.splitext(stem)[1]
    if ext.lower() == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise InputError(
                f"{path}: reading Parquet needs pyarrow; pip install pyarrow") from None
        return "parquet", None
    if compression == "zst":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise InputError(
                f"{path}: reading .zst needs zstandard; pip install zstandard") from None
    return input_format, compression


def _directory_files(directory: str, input_format: str) -> list[str]:
    suffixes = _TEXT_SUFFIXES if input_format == "text" else _JSONL_SUFFIXES
    suffixes = suffixes + (".parquet",)
    found = []
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            base = name
            for comp in _COMPRESSIONS:
                base = base.removesuffix(comp)
            if base.lower().endswith(suffixes):
                found.append(os.path.join(root, name))
    return found


def resolve_inputs(inputs: list[str], input_format: str = "jsonl") -> list[Segment]:
    """Every input file, in the order given (globs and directories sorted), as whole segments;
    InputError for one that matches nothing, is a pipe or device, or needs a missing library."""
    if input_format not in INPUT_FORMATS:
        raise InputError(f"--input-format must be one of {INPUT_FORMATS}, got {input_format!r}")
    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            matched = _directory_files(item, input_format)
            if not matched:
                suffixes = _TEXT_SUFFIXES if input_format == "text" else _JSONL_SUFFIXES
                raise InputError(
                    f"--input {item!r}: directory holds no {input_format} files "
                    f"(looked for {', '.join(suffixes)}, "
                    f".parquet, optionally .gz/.zst)"
                )
        elif os.path.isfile(item) or os.path.realpath(item) == os.devnull:
            matched = [item]  # /dev/null reads as an empty file, and is refused as one
        elif glob.has_magic(item):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise InputError(f"--input {item!r}: the pattern matches no files")
        elif os.path.exists(item):  # a pipe or a device: no byte ranges to read in parallel
            raise InputError(f"--input {item!r}: not a regular file; save it to a file first")
        else:
            raise InputError(f"--input {item!r}: no such file or directory")
        paths.extend(matched)
    _refuse_duplicates(paths)
    segments = []
    for path in paths:
        if not os.access(path, os.R_OK):
            raise InputError(f"--input {path!r}: file is not readable; check its permissions")
        kind, compression = _file_kind(path, input_format)
        segments.append(Segment(path=path, kind=kind, compression=compression))
    return segments


def _refuse_duplicates(paths: list[str]) -> None:
    """The same file twice (two spellings, or a file and its directory) would be counted twice."""
    seen: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            same = "" if seen[real] == path else f" (as {seen[real]!r})"
            raise InputError(
                f"--input {path!r}: the same file is given twice{same}, so its documents would "
                f"be counted twice; list each file once"
            )
        seen[real] = path


@dataclass
class Chunk:
    """One unit of work for a tokenising worker."""

    segment: Segment
    first_line: int
    """Line (or row) number of the chunk's first line within ``segment.path``."""
    lines: bytes | bytearray | None = None
    """Raw bytes ending at a line boundary (jsonl/text); the encoder takes them (sets None)
    so that a long line's bytes go as soon as they are decoded."""
    rows: list[dict] | None = None
    """Parquet rows as dicts (parquet)."""
    num_lines: int = 0
    num_bytes: int = 0


def iter_chunks(segment: Segment, chunk_bytes: int, json_keys: list[str],
                max_line_bytes: int | None = None) -> Iterator[Chunk]:
    """Line-aligned chunks of about ``chunk_bytes`` each; memory is bounded by one chunk, or
    by one line where a line is longer. A line over ``max_line_bytes`` (None: no limit; it
    should be at least ``chunk_bytes``) is an InputError naming it, raised before more than
    that is read of it."""
    if segment.kind == "parquet":
        yield from _parquet_chunks(segment, chunk_bytes, json_keys)
        return
    remaining = None if segment.end is None else segment.end - segment.start
    line = segment.first_line
    carry = b""
    long_line = None  # a line longer than a chunk, as it grows in place (no copy per block)
    with segment.open_binary() as f:
        while True:
            want = chunk_bytes if remaining is None else min(chunk_bytes, remaining)
            try:
                block = f.read(want) if want > 0 else b""
            except DamagedInputError as e:
                # Lines before ``line`` were complete; the data stops in or before it.
                raise InputError(
                    f"{e.path}:{line}: {e.detail}; lines from here on are lost, so re-create "
                    f"or re-download the file"
                ) from None
            if remaining is not None:
                remaining -= len(block)
            if long_line is not None:
                cut = block.find(b"\n") + 1 if block else len(block)
                long_line += memoryview(block)[:cut] if cut else block
                _check_line_length(segment, line, long_line, max_line_bytes)
                if cut == 0 and block:
                    continue
                # the long line is complete: it goes alone; the rest of the block goes on
                chunk = Chunk(segment, line, lines=long_line, num_lines=1,
                              num_bytes=len(long_line))
                long_line = None
                yield chunk
                del chunk
                line += 1
                block = block[cut:]
                if not block:
                    if cut == 0:  # end of input
                        return
                    continue
            if not block:
                if carry:  # last line without a trailing newline
                    yield Chunk(segment, line, lines=carry, num_lines=1, num_bytes=len(carry))
                return
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # a line longer than the chunk: keep reading
                long_line, carry = bytearray(block), b""
                del block
                _check_line_length(segment, line, long_line, max_line_bytes)
                continue
            carry = block[cut:]
            payload = block[:cut] if carry else block
            n = payload.count(b"\n")
            yield Chunk(segment, line, lines=payload, num_lines=n, num_bytes=len(payload))
            line += n


def _check_line_length(segment: Segment, line: int, data: bytearray,
                       max_line_bytes: int | None) -> None:
    """InputError when the line read so far (``data``) is over ``max_line_bytes``, its
    newline not counted."""
    if max_line_bytes is None:
        return
    length = len(data) - (1 if data.endswith(b"\n") else 0)
    if length > max_line_bytes:
        raise InputError(
            f"{segment.path}:{line}: the line is longer than --max-line-bytes "
            f"{max_line_bytes} ({_mib(max_line_bytes)}); split its document into several "
            f"lines, or raise --max-line-bytes"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


def _parquet_chunks(segment: Segment, chunk_bytes: int, json_keys: list[str]) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(segment.path)
    missing = [k for k in json_keys if k not in pf.schema_arrow.names]
    if missing:
        raise InputError(
            f"{segment.path}: Parquet columns {missing} not found (columns: "
            f"{pf.schema_arrow.names}); pick them with --json-keys"
        )
    row = 1
    # Rows of a few KB each are typical; aim for about chunk_bytes per batch.
    for batch in pf.iter_batches(batch_size=max(16, chunk_bytes // 2048), columns=json_keys):
        rows = batch.to_pylist()
        nbytes = batch.nbytes
        yield Chunk(segment, row, rows=rows, num_lines=len(rows), num_bytes=nbytes)
        row += len(rows)


def _next_line_start(path: str, offset: int) -> int:
    """The offset just past the first newline at or after ``offset`` (file size if none)."""
    with open(path, "rb") as f:
        f.seek(offset)
        f.readline()
        return f.tell()


def _count_newlines(path: str, start: int, end: int) -> int:
    count = 0
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            block = f.read(min(_BLOCK, left))
            if not block:
                break
            count += block.count(b"\n")
            left -= len(block)
    return count


def split_into_partitions(segments: list[Segment], partitions: int) -> list[list[Segment]]:
    """Contiguous, line-aligned groups of about equal bytes, in input order.

    Concatenating the groups gives back exactly the input lines in order, which is what
    makes a partitioned run byte-identical to an unpartitioned one. Compressed and Parquet
    files are never split; uncompressed ones are cut at line boundaries.
    """
    if partitions <= 1:
        return [list(segments)]
    total = sum(s.size() for s in segments)
    target = max(1, -(-total // partitions))
    groups: list[list[Segment]] = [[]]
    room = target
    for seg in segments:
        while True:
            size = seg.size()
            if size <= room or not seg.splittable or len(groups) == partitions:
                groups[-1].append(seg)
                room -= size
                break
            cut = _next_line_start(seg.path, seg.start + room)
            end = os.path.getsize(seg.path) if seg.end is None else seg.end
            if cut >= end:  # the cut falls in the last line: keep the file whole
                groups[-1].append(seg)
                room -= size
                break
            head = Segment(seg.path, seg.kind, None, seg.start, cut, seg.first_line)
            groups[-1].append(head)
            tail_line = seg.first_line + _count_newlines(seg.path, seg.start, cut)
            seg = Segment(seg.path, seg.kind, None, cut, seg.end, tail_line)
            groups.append([])
            room = target
        if room <= 0 and len(groups) < partitions:
            groups.append([])
            room = target
    return [g for g in groups if g]
