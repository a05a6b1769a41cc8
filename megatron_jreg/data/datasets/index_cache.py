"""megatron-core's dataset index cache is read as numbers, never unpickled.

megatron-core caches each dataset's indices as ``.npy`` files in ``--data-cache-path`` and reads
them with ``numpy.load(allow_pickle=True)``, which unpickles a file that does not start as a
``.npy``: a cache handed over with the data could run code. :func:`check_index_cache` refuses,
in one line, any ``.npy`` there that does not start with the ``.npy`` magic; ``gpt`` calls it
before megatron-core reads the cache.
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
        # A file shorter than the magic (one megatron-core is writing on another rank, or an
        # empty one) cannot hold a pickle that runs anything: every prefix of the .npy magic
        # starts with an opcode that fails at once.
        if not MAGIC.startswith(head):
            raise InputError(
                f"{file}: refused to load: not a numpy array file, so numpy would unpickle it "
                "for megatron-core's index cache and could run code; delete it (megatron-core "
                f"builds it again) or give another {flag}")
