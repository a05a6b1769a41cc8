"""The one rule for opening a checkpoint's file: a regular file inside its directory (links
resolved), opened without ever waiting on a FIFO or device. The trusted open (trusted.py),
the tracker (catalog.py) and the manifest (manifest.py) open through it."""

from __future__ import annotations

import io
import os
import stat

from megatron_jreg.checkpoint.faults import DamagedFile, UnsafeCheckpoint

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a link"}


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def inside(path: str, directory: str) -> bool:
    real, top = os.path.realpath(path), os.path.realpath(directory)
    return real == top or real.startswith(top + os.sep)


def open_regular(file: str, directory: str) -> io.BufferedReader:
    """``file`` opened for reading, refused unless it lies in ``directory`` (links
    resolved) and the descriptor opened is a regular file; opening never blocks."""
    if not inside(file, directory):
        raise UnsafeCheckpoint(file, f"it leads out of {directory}")
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise DamagedFile(path=directory, checksum=False,
                          detail=f"cannot open {file} ({err.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeCheckpoint(file, f"it is {kind_of(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
