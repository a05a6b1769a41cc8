"""Write output files under a temporary name and rename them into place; one writer each.

A reader (or a crashed run) never sees a half-written JSON, CSV or PNG, and what lands has
the mode a plain ``open(path, "w")`` gives. Temporary names carry :func:`temp_marker`, which
writer_lock.py records, so a takeover removes exactly a dead writer's temporaries;
:func:`signals_as_interrupt` turns SIGTERM/SIGHUP into KeyboardInterrupt so they are
cleaned up after a ``kill`` too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import uuid
from typing import Callable, Iterator, Optional, Set

from megatron_jreg.errors import InputError

_TAG: Optional[tuple] = None  # (pid, tag): a forked child gets a tag of its own


def writer_tag() -> str:
    """This process's mark, ``PID-RANDOM``: the random part tells a later process that
    reuses the pid from the one that died, so a takeover never removes a live run's files."""
    global _TAG
    if _TAG is None or _TAG[0] != os.getpid():
        _TAG = (os.getpid(), f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    return _TAG[1]


def temp_marker(tag: Optional[str] = None) -> str:
    """``.tmp-TAG``: every temporary name beside an output holds it (see :class:`WriterLock`)."""
    return f".tmp-{tag or writer_tag()}"


def _umask() -> int:
    try:  # Linux says it without changing it (os.umask would, for an instant, in every thread)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0)
    os.umask(umask)
    return umask


def file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file."""
    return 0o666 & ~_umask()


# Directories this process made in check_output_dir: a run that stops before writing
# anything removes the ones still empty (checkpoint.save_lock: --save), not the user's own.
MADE_DIRECTORIES: Set[str] = set()


def check_output_dir(directory: str, flag: str, path: str = None, create: bool = True) -> None:
    """Make ``directory`` (with its parents, unless ``create`` is False) and prove it takes
    a new file; else one InputError naming ``flag``, the path and the fix. Runs before any
    work, so an unwritable output never costs a model load or a training step."""
    shown = f"{flag} {path if path is not None else directory}"
    if create:
        try:
            if not os.path.isdir(directory):
                MADE_DIRECTORIES.add(os.path.abspath(directory))
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
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{temp_marker()}.",
                               suffix=f".tmp{suffix}", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, file_mode())  # mkstemp's 0600 would survive the rename
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
    name = os.path.basename(os.path.normpath(path))
    tmp = tempfile.mkdtemp(prefix=f".{name}{temp_marker()}.", dir=parent)
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def give_open_modes(directory: str) -> None:
    """Every file under ``directory`` to the mode ``open(path, "w")`` gives, every directory
    to the one ``os.mkdir`` gives: writers that stage through mkstemp (safetensors' 0600
    ``model.safetensors``) would otherwise keep others out of what is renamed into place."""
    umask = _umask()
    for root, _dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


# ---- SIGTERM as Ctrl-C ----------------------------------------------------------------------


@contextlib.contextmanager
def signals_as_interrupt(signums=(signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Raise KeyboardInterrupt(signal name) on ``signums`` inside the block, so the
    ``except BaseException``/``finally`` cleanup of temporary files runs for a ``kill`` as
    for Ctrl-C; the previous handlers come back after. Only the main thread can set them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, stop) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def stop_reason(stopped: KeyboardInterrupt) -> str:
    """The signal a :func:`signals_as_interrupt` KeyboardInterrupt names; SIGINT for Ctrl-C."""
    return str(stopped.args[0]) if stopped.args else "SIGINT"
