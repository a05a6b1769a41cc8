"""What a ``.bin``/``.idx`` pair holds, keyed by its content: the largest token id (one
chunked pass over the ``.bin``, cached) and the key of megatron-core's index cache.

:func:`index_key` keys megatron-core's document, sample and shuffle indices (they depend on the
``.idx`` alone); :func:`token_range_key` keys the cached largest token id, which depends on the
``.bin`` too. Used by ``gpt`` (the index cache) and ``run_data_check`` (the vocabulary check);
numpy and the standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy

from megatron_jreg.atomic_write import write_text_atomic
from megatron_jreg.data.preprocess.writer import DTYPE_CODES, read_header
from megatron_jreg.errors import InputError

_CHUNK_BYTES = 64 << 20  # one pass, 64 MiB at a time: a dataset of any size fits in memory
_DIGESTS: dict = {}  # (path, size, mtime_ns, inode, ctime_ns) -> SHA-256 of the .idx


def _identity(path: str) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns


def index_key(prefix: str) -> str:
    """SHA-256 of ``prefix.idx`` (hex): what megatron-core's index cache depends on (the
    sequence lengths and document boundaries). A prefix rebuilt with other documents gets
    another key; a copy of the same data elsewhere gets the same one. The ``.idx`` is 12 bytes
    a sequence, small beside the ``.bin``; memoized per process."""
    path = prefix + ".idx"
    memo = (os.path.abspath(path),) + _identity(path)
    if memo not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _DIGESTS[memo] = digest.hexdigest()
    return _DIGESTS[memo]


def token_range_key(prefix: str) -> str:
    """The ``.idx`` digest and the ``.bin``'s size, mtime_ns, inode and ctime_ns.

    Hashing the ``.bin`` would cost the very pass the cache saves, so its identity stands in:
    rewriting it in place changes its mtime and ctime (``os.utime`` can put the mtime back,
    never the ctime: the kernel sets it on every write); replacing it (every writer here
    renames a finished file) changes its inode; other documents change the ``.idx``. Copying
    or moving the pair (a rename sets the ctime too) costs one more pass."""
    size, mtime_ns, inode, ctime_ns = _identity(prefix + ".bin")
    key = f"{index_key(prefix)}:{size}:{mtime_ns}:{inode}:{ctime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def scan_max_token_id(prefix: str, part: tuple = (0, 1)) -> int:
    """The largest id in ``prefix.bin`` (-1 when empty): one pass, chunk by chunk. ``part``
    (k, n): only the k-th of n equal slices, so n ranks share the pass."""
    header = read_header(prefix + ".idx")
    if header is None or header[1] not in DTYPE_CODES:
        raise InputError(f"{prefix}.idx is not a megatron-core index file; rebuild the pair "
                         "with tools/preprocess_data.py")
    dtype = numpy.dtype(DTYPE_CODES[header[1]])
    tokens = os.path.getsize(prefix + ".bin") // dtype.itemsize
    k, n = part
    first, end = tokens * k // n, tokens * (k + 1) // n
    largest = -1
    if end <= first:
        return largest  # nothing here (numpy cannot map an empty file either)
    data = numpy.memmap(prefix + ".bin", dtype, mode="r")
    chunk = max(_CHUNK_BYTES // dtype.itemsize, 1)
    for start in range(first, end, chunk):
        largest = max(largest, int(data[start:min(start + chunk, end)].max()))
    del data
    return largest


def _cache_path(prefix: str, cache_dir: str) -> str:
    return os.path.join(cache_dir, f"token-range-{token_range_key(prefix)}.json")


def cached_max_token_id(prefix: str, cache_dir: Optional[str]) -> Optional[int]:
    """The cached largest id of this content of ``prefix`` (None: not cached). A stale value
    is never read: the file's name is the content key of :func:`token_range_key`."""
    if cache_dir is None:
        return None
    try:
        with open(_cache_path(prefix, cache_dir), encoding="utf-8") as f:
            record = json.load(f)
        largest = record["max_token_id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: computed again
    # a record that does not carry the key it is filed under (written by hand or by
    # another program) is not trusted: computed again
    if record.get("key") != token_range_key(prefix) or not isinstance(largest, int) \
            or isinstance(largest, bool) or largest < -1:
        return None
    return largest


def store_max_token_id(prefix: str, cache_dir: Optional[str], largest: int) -> None:
    """Cache it (an unwritable ``cache_dir``: not cached; the next run scans again)."""
    if cache_dir is None:
        return
    try:
        os.makedirs(cache_dir, exist_ok=True)
        write_text_atomic(_cache_path(prefix, cache_dir),
                          json.dumps({"max_token_id": largest, "prefix": prefix,
                                      "key": token_range_key(prefix)}) + "\n")
    except OSError:
        pass


def max_token_id(prefix: str, cache_dir: Optional[str]) -> int:
    """The largest id in ``prefix.bin``, from the cache or one pass (then cached)."""
    largest = cached_max_token_id(prefix, cache_dir)
    if largest is None:
        largest = scan_max_token_id(prefix)
        store_max_token_id(prefix, cache_dir, largest)
    return largest
