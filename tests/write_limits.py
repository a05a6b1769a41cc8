"""Places where writes fail, for the tests of OS errors of writing: a file size limit (as
``ulimit -f`` sets it: EFBIG), a tiny tmpfs (ENOSPC) and a read-only one (EROFS), and the
check of what a command says then.

A Python process ignores SIGXFSZ (the interpreter sets it so at start-up), so under a plain
``ulimit -f`` a write past the limit fails with EFBIG instead of killing the process: the
tests limit the command's process as a shell does, and nothing more. The tests run as root,
whom file modes do not stop (EACCES): a read-only mount is what refuses root.
"""

import contextlib
import os
import resource
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_limited(argv, env, limit=None, timeout=600):
    """``python *argv`` in the repository, its files limited to ``limit`` bytes each (None:
    no limit); stdout and stderr captured."""
    def apply():
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=apply)


@contextlib.contextmanager
def tiny_disk(path, size):
    """A tmpfs of ``size`` (mount's words: "64k") mounted on directory ``path`` for the
    block; skips the test where this process may not mount one."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield str(path)
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def make_read_only(path):
    """Remount the tmpfs on ``path`` (from :func:`tiny_disk`) read-only."""
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True, capture_output=True)


def one_line(proc, start, *parts):
    """``proc`` stopped with exit 2 and one line on stderr, no traceback: the line that
    begins with ``start`` and holds each of ``parts`` (returned)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, \
        f"exit {proc.returncode}, stderr:\n{proc.stderr[-4000:]}"
    line = lines[0]
    assert "Traceback" not in proc.stderr and line.startswith(start), line
    for part in parts:
        assert part in line, (part, line)
    return line


LIMIT_FIX = "was reached; raise it (`ulimit -f unlimited`) or write smaller files"
FULL = "the disk is full; free space or write elsewhere"
READ_ONLY = "the file system is read-only; write elsewhere, or remount it read-write"
