"""Write output files under a temporary name and rename them into place.

A reader (or a crashed run) never sees a half-written JSON, CSV or PNG.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable

from megatron_jreg.errors import InputError


def check_output_dir(directory: str, flag: str, path: str = None, create: bool = True) -> None:
    """Make ``directory`` (with its parents, unless ``create`` is False) and prove it takes
    a new file; else one InputError naming ``flag``, the path and the fix. Runs before any
    work, so an unwritable output never costs a model load or a training step."""
    shown = f"{flag} {path if path is not None else directory}"
    if create:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as err:
            raise InputError(f"{shown}: cannot create directory {directory} "
                             f"({err.strerror}); choose a writable location") from None
    if not os.path.isdir(directory):
        raise InputError(f"{shown}: {directory} is not a directory; choose another path")
    try:  # os.access says yes to root on read-only mounts: create a file to know
        fd, probe = tempfile.mkstemp(prefix=".jreg-write-check-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise InputError(f"{shown}: cannot write in {directory} ({err.strerror}); choose a "
                         "writable location") from None


def check_output_path(path: str, flag: str, create: bool = True) -> None:
    """An output file: its directory made if missing and writable, the path not a
    directory (see :func:`check_output_dir`)."""
    if os.path.isdir(path):
        raise InputError(f"{flag} {path}: is a directory; give a file name")
    check_output_dir(os.path.dirname(os.path.abspath(path)), flag, path, create)


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


def temp_dir_beside(path: str) -> str:
    """A new empty directory beside ``path`` (same file system: it can be renamed to
    ``path``), with the permissions the umask gives a new directory (mkdtemp's 0700 would
    survive the rename)."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(path))}.", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp
