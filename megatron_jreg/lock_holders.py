"""Who holds a lock file and whether that holder is gone: the record's holder identity
(:func:`process_identity`), the ``flock`` a holder keeps on its lock file, and the rules that
judge a record (:func:`takeover_reason`) and word a live one (:func:`liveness`). The lock
itself is :mod:`megatron_jreg.writer_lock`'s."""

from __future__ import annotations

import calendar
import errno
import fcntl
import os
import time
from typing import Dict, Optional, Tuple

MAX_LEASE_S = 1e6  # about 11 days: longer is no lease at all


def valid_lease(value) -> bool:
    """A lease a record may carry: a number of seconds in the range a holder can set."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 1.0 <= value <= MAX_LEASE_S)


def slurm_job() -> Dict:
    """This process's Slurm job id and restart count (None and 0 outside Slurm)."""
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    return {"slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
            "slurm_restart_count": int(restart) if restart.isdigit() else 0}


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


def keep_flock(fd: int, path: str) -> bool:
    """Take the ``flock`` of the lock file open at ``fd`` for as long as this process keeps
    ``fd`` open (:func:`drop_flock`); False on a file system without flock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    _FLOCKED[fd] = path
    return True


def drop_flock(fd: int) -> None:
    _FLOCKED.pop(fd, None)
    os.close(fd)


def _close_in_child() -> None:
    for fd in list(_FLOCKED):
        try:
            os.close(fd)
        except OSError:
            pass
    _FLOCKED.clear()


os.register_at_fork(after_in_child=_close_in_child)


def flock_free(path: str) -> Optional[bool]:
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
        free = flock_free(path)
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
    if started is None:  # an earlier version's record: the time it was taken tells
        return True, _older_than_its_pid(holder, pid)
    return True, None


CLOCK_SLACK_S = 60.0  # wall-clock steps (NTP) a record's time may be off by


def _record_time(holder: Dict) -> Optional[float]:
    """When the lock was taken, from the record's ``start_time`` ("%Y-%m-%d %H:%M:%S %Z")."""
    text = holder.get("start_time")
    if not isinstance(text, str) or len(text) > 64:
        return None
    try:
        parsed = time.strptime(text, "%Y-%m-%d %H:%M:%S %Z")
    except ValueError:
        return None
    return calendar.timegm(parsed) if text.endswith((" UTC", " GMT")) else time.mktime(parsed)


def _boot_time() -> Optional[float]:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _older_than_its_pid(holder: Dict, pid: int) -> Optional[str]:
    """Why a record without a start time is not of the live process ``pid`` now has (it was
    taken before this host's boot, or before that process started), or None."""
    taken, boot = _record_time(holder), _boot_time()
    if taken is None or boot is None:
        return None
    if taken < boot - CLOCK_SLACK_S:
        return "it ran before this host last started (its lock is older than the boot)"
    ticks = _start_ticks(pid)
    if ticks is not None and boot + ticks / os.sysconf("SC_CLK_TCK") > taken + CLOCK_SLACK_S:
        return f"pid {pid} now belongs to another process, started after the lock was taken"
    return None


def takeover_reason(holder: Dict, age: Optional[float], host: str, job: Dict,
                    path: str = "") -> Optional[str]:
    """Why ``holder`` (the record of lock file ``path``, whose heartbeat is ``age`` seconds
    old) is gone, seen from a process on ``host`` in Slurm ``job``; None when it may be
    alive. A holder is gone when:

    - the same Slurm job (``SLURM_JOB_ID``) was requeued, on any host: this process's
      ``SLURM_RESTART_COUNT`` is higher than the holder's;
    - on the same host, the holder ran before the host's last boot, or no process holds the
      file's ``flock`` any more (a SIGKILL, an OOM kill, a container restarted with the same
      pid 1), or, for a record without the ``flock``: its pid is not running, is this very
      process, or belongs to a process that started at another time (or, for an earlier
      version's record, after the lock was taken);
    - on another host, the heartbeat is older than the lease (``LEASE_S``, 600 s, or
      ``MEGATRON_JREG_LOCK_LEASE_S``): the node died or lost the file system.

    A live holder keeps its lock; an earlier version's lock (no lease) on another host
    cannot be judged and holds."""
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
    if valid_lease(lease) and age is not None and age > lease:
        return (f"its last heartbeat is {_seconds(age)} s old, past its lease of "
                f"{_seconds(lease)} s")
    return None


def liveness(holder: Dict, age: Optional[float], host: str, path: str) -> str:
    """Why a holder counts as alive, for the refusal."""
    if not holder:
        return ("its lock file is empty or unreadable (torn by a full disk or a crash, or not "
                "this program's), so its holder cannot be judged")
    lease = holder.get("lease_s")
    if holder.get("host") == host:
        if _judge_same_host(holder, path)[0]:
            return "its process is running on this host"
        if not (valid_lease(lease) and age is not None):
            return ("it runs in another pid namespace of this host (a container) and its lock "
                    "has no lease to judge")
    if valid_lease(lease) and age is not None:
        return (f"its heartbeat is {_seconds(max(age, 0))} s old, within its lease of "
                f"{_seconds(lease)} s "
                "(the lock is taken over once the lease lapses)")
    return ("it runs on another host and its lock has no lease (an earlier version's, or an "
            "invalid one) to judge")


