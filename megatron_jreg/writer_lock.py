"""One writer per output: a lock file naming its holder, taken over only from a holder that is
provably gone.

The lock is created with ``O_CREAT | O_EXCL`` (of two processes starting together exactly
one wins) and holds the holder's host, pid, who that pid is (the host's boot id, the pid
namespace and the process's start time, :func:`process_identity`), run id, temporary-name
tag (:func:`atomic_write.temp_marker`), Slurm job id and restart count, and its lease. The
holder also keeps an ``flock`` on the file for as long as it lives: the kernel drops it when
the process ends, however it ends, in whatever pid namespace it ran. While it holds the
lock, the holder refreshes the file's modification time every ``lease / 10`` seconds (the
heartbeat). A lock is taken over when its holder is gone (:func:`takeover_reason`):

- the same Slurm job (``SLURM_JOB_ID``) requeued, on any host: this process's
  ``SLURM_RESTART_COUNT`` is higher than the holder's;
- the same host, and the holder ran before the host's last boot, or no process holds the
  file's ``flock`` any more (a SIGKILL, an OOM kill, a container restarted with the same
  pid 1), or, for a record without the ``flock``: its pid is not running, is this very
  process, or belongs to a process that started at another time;
- another host, and the heartbeat is older than the lease (:data:`LEASE_S`, 600 s, or
  ``MEGATRON_JREG_LOCK_LEASE_S``): the node died or lost the file system.

A live holder keeps its lock. A lock of an earlier version (no lease) on another host
cannot be judged and holds. Each takeover prints one line naming the holder and the rule
that applied. A holder whose lock was taken over (its lease lapsed while it was stopped,
say) learns it from :meth:`WriterLock.still_held` and writes nothing more (the trainer
checks before each save).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_jreg.atomic_write import check_output_dir, temp_marker, writer_tag
from megatron_jreg.errors import InputError

LEASE_S = 600.0  # the heartbeat's age after which a holder on another host counts as gone
LEASE_ENV = "MEGATRON_JREG_LOCK_LEASE_S"
MAX_LEASE_S = 1e6  # about 11 days: longer is no lease at all
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


def _valid_lease(value) -> bool:
    """A lease a record may carry: a number of seconds in the range a holder can set."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 1.0 <= value <= MAX_LEASE_S)


def _slurm_job() -> Dict:
    """This process's Slurm job id and restart count (None and 0 outside Slurm)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
            "slurm_restart_count": int(restart) if restart.isdigit() else 0}


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


def _read_small(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read(256).strip() or None
    except OSError:
        return None


def _start_ticks(pid) -> Optional[int]:
    """When process ``pid`` (of this pid namespace) started, in clock ticks since boot."""
    text = _read_small(f"/proc/{pid}/stat")
    try:
        return int(text.rsplit(")", 1)[1].split()[19]) if text else None
    except (IndexError, ValueError):
        return None


def _pid_namespace(pid="self") -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def process_identity() -> Dict:
    """What tells this process from any other on its host, across restarts: the host's boot
    id, the pid namespace and the start time (None where /proc does not say)."""
    return {"boot_id": _read_small("/proc/sys/kernel/random/boot_id"),
            "pid_namespace": _pid_namespace(), "start_ticks": _start_ticks("self")}


# the lock files this process holds an flock on (fd -> path): a child forked by the holder
# (a data loader worker) closes its copies, so only the holder's own end keeps the flock
_FLOCKED: Dict[int, str] = {}


def _close_in_child() -> None:
    for fd in list(_FLOCKED):
        try:
            os.close(fd)
        except OSError:
            pass
    _FLOCKED.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _flock_free(path: str) -> Optional[bool]:
    """Whether no process holds an flock on ``path`` (True: its holder ended), False while
    one does, None when this file system cannot say."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        return False if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    finally:
        os.close(fd)  # also drops the flock this call may have taken
    return True


def _read_record(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            record = json.loads(f.read(RECORD_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return {}  # torn or garbage: treated as a lock of unknown holder
    return record if isinstance(record, dict) else {}


def _heartbeat_age(path: str) -> Optional[float]:
    """Seconds since the holder last refreshed ``path`` (None when it is gone)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None


def _seconds(value: float) -> str:
    return f"{value:.1f}" if abs(value) < 10 else f"{value:.0f}"


def describe_holder(holder: Dict) -> str:
    if not holder:
        return "an unknown process (unreadable lock)"
    job = holder.get("slurm_job_id")
    slurm = f", Slurm job {job} restart {holder.get('slurm_restart_count', 0)}" if job else ""
    return (f"pid {holder.get('pid')} on host {holder.get('host')}{slurm}, started "
            f"{holder.get('start_time')}")


def _judge_same_host(holder: Dict, path: str) -> Tuple[bool, Optional[str]]:
    """``(judged, reason)`` for ``holder``, a record written on this host: ``reason`` says why
    it is gone (None: alive); not ``judged`` when nothing here can tell (a pid of another pid
    namespace, without an flock to ask)."""
    if not holder:
        return True, None  # unreadable: may be alive
    here = process_identity()
    boot = holder.get("boot_id")
    if isinstance(boot, str) and here["boot_id"] and boot != here["boot_id"]:
        return True, "it ran before this host last started (another boot id)"
    if holder.get("flock") is True:
        free = _flock_free(path)
        if free is not None:  # the kernel's answer, in any pid namespace
            return True, ("no process holds its lock file any more (it ended)" if free else None)
    pid = holder.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool):
        return True, None
    space = holder.get("pid_namespace")
    if space is not None and space != here["pid_namespace"]:
        return False, None  # another pid namespace's pid: not one this process can look up
    if pid == os.getpid():
        return True, (f"it names this very process (pid {pid}), which did not take it: a "
                      "restart that got the same pid")
    if not _pid_alive(pid):
        return True, "its process is no longer running"
    started = holder.get("start_ticks")
    if isinstance(started, int) and _start_ticks(pid) not in (None, started):
        return True, f"pid {pid} now belongs to another process, started at another time"
    return True, None


def takeover_reason(holder: Dict, age: Optional[float], host: str, job: Dict,
                    path: str = "") -> Optional[str]:
    """Why ``holder`` (the record of lock file ``path``, whose heartbeat is ``age`` seconds
    old) is gone, seen from a process on ``host`` in Slurm ``job``; None when it may be
    alive."""
    theirs, restart = holder.get("slurm_job_id"), holder.get("slurm_restart_count")
    if (theirs and theirs == job["slurm_job_id"] and isinstance(restart, int)
            and job["slurm_restart_count"] > restart):
        # on any host: a pid there may since belong to another process
        return (f"Slurm requeued job {theirs} (this is restart {job['slurm_restart_count']}, "
                f"the holder ran as restart {restart})")
    if holder.get("host") == host or not holder:
        judged, reason = _judge_same_host(holder, path)
        if judged:
            return reason
        # a holder in another pid namespace of this host, without an flock to ask: its
        # heartbeat decides, as for another host
    lease = holder.get("lease_s")
    if _valid_lease(lease) and age is not None and age > lease:
        return (f"its last heartbeat is {_seconds(age)} s old, past its lease of "
                f"{_seconds(lease)} s")
    return None


def _liveness(holder: Dict, age: Optional[float], host: str, path: str) -> str:
    """Why a holder counts as alive, for the refusal."""
    if not holder:
        return ("its lock file is empty or unreadable (torn by a full disk or a crash, or not "
                "this program's), so its holder cannot be judged")
    lease = holder.get("lease_s")
    if holder.get("host") == host:
        if _judge_same_host(holder, path)[0]:
            return "its process is running on this host"
        if not (_valid_lease(lease) and age is not None):
            return ("it runs in another pid namespace of this host (a container) and its lock "
                    "has no lease to judge")
    if _valid_lease(lease) and age is not None:
        return (f"its heartbeat is {_seconds(max(age, 0))} s old, within its lease of "
                f"{_seconds(lease)} s "
                "(the lock is taken over once the lease lapses)")
    return ("it runs on another host and its lock has no lease (an earlier version's, or an "
            "invalid one) to judge")


class WriterLock:
    """The lock file ``path`` (see the module's docstring). :meth:`acquire` returns None
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
                  **_slurm_job()}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            return False
        try:
            try:  # before the record says so: a record with "flock" is always flocked
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                record["flock"] = False  # a file system without flock: the pid decides
            data = json.dumps(record).encode()
            if os.write(fd, data) != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
        except BaseException:  # a full disk, say: no empty lock may stay to block later runs
            os.close(fd)
            os.remove(self.path)
            raise
        self._fd = fd
        _FLOCKED[fd] = self.path
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
        host, job = socket.gethostname(), _slurm_job()
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
        raise self.busy(holder, _liveness(holder, age, host, self.path))

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
            _FLOCKED.pop(self._fd, None)
            os.close(self._fd)
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
