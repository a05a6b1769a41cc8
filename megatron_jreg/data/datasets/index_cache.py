"""megatron-core's dataset index cache is read as numbers, never unpickled.

megatron-core caches each dataset's document, sample and shuffle indices (and a blend's)
as ``.npy`` files in ``--data-cache-path`` (by default ``index-cache`` beside the data) and
reads them with ``numpy.load(allow_pickle=True, mmap_mode="r")``. numpy maps a file that
starts as a ``.npy`` does (and refuses to map one holding Python objects), but unpickles a
file that does not: a cache handed over with the data could run code.
:func:`check_index_cache` reads the first bytes of each ``.npy`` there first and refuses,
in one line, any that does not start as a ``.npy``. A file shorter than that prefix (one
megatron-core is writing on another rank, or an empty one) cannot hold a pickle that runs
anything: every prefix of the ``.npy`` magic starts with an opcode that fails at once.
"""

from __future__ import annotations

import os

from numpy.lib import format as npy

from megatron_jreg.errors import InputError

MAGIC = npy.MAGIC_PREFIX  # b"\x93NUMPY"


def check_index_cache(directory: str, flag: str = "--data-cache-path") -> None:
    """Raise InputError naming the first ``*.npy`` in ``directory`` that numpy would
    unpickle (``flag`` names where the directory comes from)."""
    if not os.path.isdir(directory):
        return
    for name in sorted(os.listdir(directory)):
        file = os.path.join(directory, name)
        if not name.endswith(".npy"):
            continue
        try:
            with open(file, "rb") as f:
                head = f.read(len(MAGIC))
        except (IsADirectoryError, FileNotFoundError):  # not a file, or removed meanwhile
            continue
        if not MAGIC.startswith(head):
            raise InputError(
                f"{file}: refused to load: not a numpy array file, so numpy would unpickle it "
                "for megatron-core's index cache and could run code; delete it (megatron-core "
                f"builds it again) or give another {flag}")
