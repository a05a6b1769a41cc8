"""Write output files under a temporary name and rename them into place.

A reader (or a crashed run) never sees a half-written JSON, CSV or PNG.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

from megatron_jreg.errors import InputError


def check_output_path(path: str, flag: str) -> None:
    """Fail early, before any model is loaded, when ``path`` cannot be written."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise InputError(f"{flag} {path}: directory {directory} does not exist; create it first")
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a directory; give a file name")


def write_atomic(path: str, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` and rename the result to ``path``.

    The temporary file sits beside ``path`` (same file system, so the rename is atomic)
    and keeps its suffix, so writers that pick a format from the extension still work.
    """
    directory = os.path.dirname(os.path.abspath(path))
    base, suffix = os.path.splitext(os.path.basename(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=f".tmp{suffix}", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomic(path, write)
