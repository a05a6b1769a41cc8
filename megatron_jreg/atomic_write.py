"""Write output files under a temporary name and rename them into place; one writer each.

A reader (or a crashed run) never sees a half-written JSON, CSV or PNG, and what lands has
the mode a plain ``open(path, "w")`` gives (0666 & ~umask), not mkstemp's 0600.

:class:`WriterLock` (``O_CREAT | O_EXCL`` of a lock file naming its holder; a lock of a dead
process on this host is taken over) keeps one writer per output: :func:`output_lock` for
the tools' files, ``checkpoint.save_lock`` for the trainer's ``--save``. Temporary names
carry :func:`temp_marker` (pid and a random part) and the lock file records it, so taking
over the lock of a SIGKILLed writer removes exactly that writer's temporaries beside the
output, never a live writer's (a reused pid has another random part).
:func:`signals_as_interrupt` turns SIGTERM/SIGHUP into KeyboardInterrupt, so the cleanup
of temporary files that Ctrl-C runs also runs for a ``kill``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Callable, Dict, Iterator, List, Optional, Sequence

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
    for root, dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


# ---- one writer per output ------------------------------------------------------------------


class OutputBusy(InputError):
    """Another live process holds the lock of an output."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read_record(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or garbage: treated as a lock of unknown holder


def describe_holder(holder: Dict) -> str:
    if not holder:
        return "an unknown process (unreadable lock)"
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started "
            f"{holder.get('start_time')}")


class WriterLock:
    """The lock file ``path``: created with ``O_EXCL`` holding host, pid, start time and run
    id, removed by :meth:`release`. A lock whose process is gone (same host, dead pid: a
    SIGKILL, a power cut) is taken over, so it never blocks a later run; one of another
    host cannot be judged and holds. :meth:`acquire` returns None when it took the lock,
    a warning line when it took over a stale one, and raises :class:`OutputBusy` from
    :meth:`busy` when a live process holds it. The record's ``temp_tag`` names the holder's
    temporaries; :meth:`remove_leftovers` removes a dead holder's at takeover."""

    label = ""  # what the takeover line names before "took over"

    def __init__(self, path: str):
        self.path = path
        self.run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.held = False

    def remove_leftovers(self, holder: Dict) -> List[str]:
        """Remove the temporaries the dead ``holder`` left; returns their names."""
        return []

    def busy(self, holder: Dict) -> Exception:
        return OutputBusy(f"{self.path} is held by {describe_holder(holder)}")

    def _create(self) -> bool:
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "start_time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run_id": self.run_id,
                  "temp_tag": writer_tag()}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        self.held = True
        return True

    def acquire(self) -> Optional[str]:
        if self._create():
            return None
        holder = _read_record(self.path)
        if holder is None and self._create():  # released between the two calls
            return None
        holder = holder or {}
        host, pid = holder.get("host"), holder.get("pid")
        if host == socket.gethostname() and isinstance(pid, int) and not _pid_alive(pid):
            # move the stale lock aside under a unique name: of two runs taking it over at
            # once, only one rename succeeds and only one O_EXCL create after it
            aside = f"{self.path}.stale-{self.run_id}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                pass
            else:
                os.remove(aside)
            if self._create():  # ours now: no writer of this output can start meanwhile
                removed = self.remove_leftovers(holder)
                gone = f"; removed its temporaries {', '.join(removed)}" if removed else ""
                return (f"warning: {self.label}took over the lock of a process no longer running (pid {pid} "
                        f"on {host}, started {holder.get('start_time')}){gone}")
            holder = _read_record(self.path) or {}
        raise self.busy(holder)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = _read_record(self.path)
        if holder and holder.get("run_id") == self.run_id:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def lock_path(path: str) -> str:
    """The lock file of output ``path`` (a file, a directory or a dataset prefix): a hidden
    ``.NAME.lock`` beside it."""
    path = os.path.abspath(path)
    return os.path.join(os.path.dirname(path), f".{os.path.basename(os.path.normpath(path))}.lock")


class _OutputLock(WriterLock):
    def __init__(self, output: str, flag: str, fix: Optional[str]):
        super().__init__(lock_path(output))
        self.output = os.path.abspath(output)
        self.shown = f"{flag} {output}" if flag else output
        self.label = f"{self.shown}: "
        self.fix = fix or "wait for it to end or choose another output"

    def remove_leftovers(self, holder: Dict) -> List[str]:
        """Names beside the output that start with its name (``.NAME`` for hidden ones) and
        carry the dead holder's :func:`temp_marker`: its .tmp files, spill files, staging
        directories."""
        tag = holder.get("temp_tag")
        if not isinstance(tag, str) or not tag:
            return []  # a lock of an older version: its temporaries cannot be told apart
        directory, name = os.path.split(os.path.normpath(self.output))
        marker, removed = temp_marker(tag), []
        for entry in sorted(os.listdir(directory)):
            if marker not in entry or not (entry.startswith(name) or entry.startswith(f".{name}")):
                continue
            path = os.path.join(directory, entry)
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
            except FileNotFoundError:
                pass
            removed.append(entry)
        return removed

    def busy(self, holder: Dict) -> Exception:
        return OutputBusy(f"{self.shown}: another process ({describe_holder(holder)}) is "
                          f"writing it; {self.fix} (if that process is gone, delete {self.path})")


@contextlib.contextmanager
def output_lock(path: str, flag: str = "", fix: Optional[str] = None) -> Iterator[None]:
    """Hold the lock of output ``path`` for the block: OutputBusy (an InputError: one line,
    exit 2) naming ``flag``/``path`` when another process writes it. Take it before looking
    whether ``path`` exists, so that check and the write are one writer's. The directory
    of ``path`` is made and checked first (:func:`check_output_dir`)."""
    check_output_dir(os.path.dirname(os.path.abspath(path)), flag, path)
    lock = _OutputLock(path, flag, fix)
    warning = lock.acquire()
    if warning:
        print(warning, file=sys.stderr)
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def output_locks(outputs: Sequence[tuple], fix: Optional[str] = None) -> Iterator[None]:
    """:func:`output_lock` of every ``(flag, path)`` whose path is set; a path given twice is
    locked once."""
    seen = set()
    with contextlib.ExitStack() as stack:
        for flag, path in outputs:
            if path and lock_path(path) not in seen:
                seen.add(lock_path(path))
                stack.enter_context(output_lock(path, flag, fix))
        yield


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
