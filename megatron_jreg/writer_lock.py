"""One writer per output: a lock file naming its holder, taken over only from a holder that is
provably gone.

The lock is created with ``O_CREAT | O_EXCL``, records its holder (host, pid and process
identity, run id, temporary-name tag, Slurm job, lease), keeps an ``flock`` and a heartbeat,
and is taken over only by the rules of ``lock_holders.takeover_reason``. The trainer's
``--save`` lock (``checkpoint.save_lock``) and the tools' outputs (:func:`output_lock`) use
it; a holder checks :meth:`WriterLock.still_held` before it writes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from typing import Dict, Iterator, List, Optional, Sequence

from megatron_jreg.atomic_write import check_output_dir, temp_marker, writer_tag
from megatron_jreg.errors import InputError
from megatron_jreg.lock_holders import (
    MAX_LEASE_S,
    describe_holder,
    drop_flock,
    keep_flock,
    liveness,
    process_identity,
    slurm_job,
    takeover_reason,
)

LEASE_S = 600.0  # the heartbeat's age after which a holder on another host counts as gone
LEASE_ENV = "MEGATRON_JREG_LOCK_LEASE_S"
RECORD_BYTES = 65536  # a lock record is a few hundred bytes: more is not one of ours


def lease_seconds() -> float:
    """The lease this process's locks carry: :data:`LEASE_S`, or ``MEGATRON_JREG_LOCK_LEASE_S``
    (a shorter lease takes over a dead node's lock sooner; it must outlast any stall of a
    live holder, such as a long collective on a slow file system)."""
    raw = os.environ.get(LEASE_ENV)
    if raw is None:
        return LEASE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 1.0 <= value <= MAX_LEASE_S:  # also NaN
        raise InputError(f"{LEASE_ENV}={raw!r}: give the lease in seconds, from 1 to "
                         f"{MAX_LEASE_S:.0f} (default {LEASE_S:.0f})")
    return value


class OutputBusy(InputError):
    """Another live process holds the lock of an output."""


def _read_record(path: str) -> Optional[Dict]:
    """The lock record at ``path``: None when there is none, {} when it cannot be read as
    one (torn, garbage, or not a regular file: a FIFO there is never waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            record = json.loads(f.read(RECORD_BYTES))
    except (OSError, ValueError, RecursionError):
        return {}  # torn or garbage: treated as a lock of unknown holder
    return record if isinstance(record, dict) else {}


def _heartbeat_age(path: str) -> Optional[float]:
    """Seconds since the holder last refreshed ``path`` (None when it is gone)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


class WriterLock:
    """The lock file ``path``, created with ``O_CREAT | O_EXCL`` (of two processes starting
    together exactly one wins). Its record names the holder: host, pid and who that pid is
    (the host's boot id, the pid namespace and the process's start time,
    :func:`process_identity`), run id, temporary-name tag (:func:`atomic_write.temp_marker`),
    Slurm job id and restart count, and its lease. The holder also keeps an ``flock`` on the
    file for as long as it lives (the kernel drops it when the process ends, however it ends,
    in whatever pid namespace it ran) and refreshes the file's modification time every
    ``lease / 10`` seconds (the heartbeat). :meth:`acquire` returns None
    when it took the lock, a warning line when it took over a gone holder's, and raises
    :meth:`busy`'s error when a live process holds it. The record's ``temp_tag`` names the
    holder's temporaries; :meth:`remove_leftovers` removes a gone holder's at takeover."""

    label = ""  # what the takeover line names before "took over"

    def __init__(self, path: str):
        self.path = path
        self.run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.held = False
        self.lease = lease_seconds()
        self._stop = threading.Event()
        self._beat: Optional[threading.Thread] = None
        self._fd: Optional[int] = None  # the open lock file whose flock this holder keeps

    def remove_leftovers(self, holder: Dict) -> List[str]:
        """Remove the temporaries the gone ``holder`` left; returns their names."""
        return []

    def busy(self, holder: Dict, why: str) -> Exception:
        return OutputBusy(f"{self.path} is held by {describe_holder(holder)} ({why})")

    def _create(self) -> bool:
        record = {"host": socket.gethostname(), "pid": os.getpid(), **process_identity(),
                  "flock": True, "start_time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                  "run_id": self.run_id, "temp_tag": writer_tag(), "lease_s": self.lease,
                  **slurm_job()}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        held = None  # the read-only descriptor that keeps the flock: no file stays open for
        try:  # writing, so the file system can still be remounted read-only, say
            held = os.open(self.path, os.O_RDONLY)
            # before the record says so: a record with "flock" is always flocked (a file
            # system without flock: the pid decides)
            record["flock"] = keep_flock(held, self.path)
            if not record["flock"]:
                drop_flock(held)
                held = None
            data = json.dumps(record).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        except BaseException:  # a full disk, say: no empty lock may stay to block later runs
            if held is not None:
                drop_flock(held)
            os.remove(self.path)
            raise
        finally:
            os.close(fd)
        self._fd = held
        self.held = True
        self._start_heartbeat()
        return True

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="jreg-lock-heartbeat",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease / 10):
            if not self.still_held():
                return  # taken over: the file is another holder's now
            try:
                os.utime(self.path)
            except OSError:
                pass  # gone meanwhile, or the file system is away: still_held() tells

    def still_held(self) -> bool:
        """True while the lock file is this holder's (no one took it over)."""
        record = _read_record(self.path)
        return bool(self.held and record and record.get("run_id") == self.run_id)

    def _move_aside(self, holder: Dict) -> bool:
        """Remove the judged ``holder``'s lock file, and only it: it is renamed to a unique
        name first (of two processes taking it over at once, one rename succeeds), and a
        file that turns out to be another's (replaced since it was judged) goes back."""
        aside = f"{self.path}.stale-{self.run_id}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return True  # already removed: the O_EXCL create decides
        moved = _read_record(aside)
        if moved is not None and moved.get("run_id") != holder.get("run_id"):
            try:
                os.link(aside, self.path)  # back, unless a new lock appeared meanwhile
            except FileExistsError:
                pass
            os.remove(aside)
            return False
        os.remove(aside)
        return True

    def acquire(self) -> Optional[str]:
        if self._create():
            return None
        host, job = socket.gethostname(), slurm_job()
        holder = _read_record(self.path)
        if holder is None and self._create():  # released between the two calls
            return None
        holder = holder or {}
        age = _heartbeat_age(self.path)
        reason = takeover_reason(holder, age, host, job, self.path)
        if reason and self._move_aside(holder) and self._create():
            # ours now: no writer of this output can start meanwhile
            removed = self.remove_leftovers(holder)
            gone = f"; removed its temporaries {', '.join(removed)}" if removed else ""
            return (f"warning: {self.label}took over the lock of {describe_holder(holder)}: "
                    f"{reason}{gone}")
        if reason:  # another process took it first
            holder, age = _read_record(self.path) or {}, _heartbeat_age(self.path)
        raise self.busy(holder, liveness(holder, age, host, self.path))

    def release(self) -> None:
        if not self.held:
            return
        self._stop.set()
        if self._beat is not None and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        mine = self.still_held()
        self.held = False
        if mine:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
        if self._fd is not None:  # after the removal: until then the flock says "alive"
            drop_flock(self._fd)
            self._fd = None


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
        carry the gone holder's :func:`temp_marker`: its .tmp files, spill files, staging
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

    def busy(self, holder: Dict, why: str) -> Exception:
        return OutputBusy(f"{self.shown}: another process ({describe_holder(holder)}) is "
                          f"writing it, {why}; {self.fix} (if that process is gone, delete "
                          f"{self.path})")


@contextlib.contextmanager
def output_lock(path: str, flag: str = "", fix: Optional[str] = None) -> Iterator[None]:
    """Hold the lock of output ``path`` for the block: OutputBusy (an InputError: one line,
    exit 2) naming ``flag``/``path`` when another process writes it. Take it before looking
    whether ``path`` exists, so that check and the write are one writer's. The directory
    of ``path`` is made and checked first (:func:`atomic_write.check_output_dir`)."""
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
