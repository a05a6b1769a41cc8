"""The writer lock across hosts: a requeued Slurm job or a lapsed lease takes over a gone
holder's lock with one line naming it; a live holder (fresh heartbeat) keeps it; a holder
whose lock was taken over knows it and leaves the new holder's file alone.

Another host's holder is a lock record written by hand (its host is not this one); a live
holder is a WriterLock of this process, whose heartbeat thread refreshes the file."""

import json
import os
import re
import socket
import time

import pytest

from megatron_jreg.checkpoint.save_lock import SaveDirectoryBusy, SaveLock
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import LEASE_ENV, OutputBusy, WriterLock, lease_seconds


def write_record(path, age_s=0.0, **fields):
    record = {"host": "node-a", "pid": 4321, "start_time": "then", "run_id": "4321-gone",
              "temp_tag": "4321-gone", "lease_s": 600.0, "slurm_job_id": None,
              "slurm_restart_count": 0}
    record.update(fields)
    with open(path, "w") as f:
        json.dump({k: v for k, v in record.items() if v is not ...}, f)
    now = time.time()
    os.utime(path, (now - age_s, now - age_s))


@pytest.fixture
def slurm(monkeypatch):
    def set_job(job_id=None, restart=None):
        for key, value in (("SLURM_JOB_ID", job_id), ("SLURM_RESTART_COUNT", restart)):
            if value is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, str(value))
    set_job()
    monkeypatch.delenv(LEASE_ENV, raising=False)
    return set_job


def test_requeued_slurm_job_takes_over_its_own_lock_on_another_host(tmp_path, slurm):
    slurm(job_id=4242, restart=1)
    write_record(tmp_path / "jreg_writer.lock", slurm_job_id="4242", slurm_restart_count=0)
    lock = SaveLock(str(tmp_path))
    warning = lock.acquire()
    assert warning == ("warning: took over the lock of pid 4321 on host node-a, Slurm job 4242 "
                       "restart 0, started then: Slurm requeued job 4242 (this is restart 1, the "
                       f"holder ran as restart 0) (in {tmp_path})")
    record = json.load(open(tmp_path / "jreg_writer.lock"))
    assert (record["host"], record["pid"], record["slurm_job_id"],
            record["slurm_restart_count"]) == (
        socket.gethostname(), os.getpid(), "4242", 1)
    lock.release()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("job_id,restart,theirs", [
    (4242, 0, "4242"),  # a second job step of the same allocation: may be live
    (4243, 1, "4242"),  # another job
    (None, None, "4242"),  # not under Slurm
    (4242, 1, None),  # the holder was not under Slurm
], ids=["same-restart", "other-job", "no-slurm-here", "no-slurm-there"])
def test_a_fresh_heartbeat_on_another_host_keeps_the_lock(tmp_path, slurm, job_id, restart, theirs):
    slurm(job_id=job_id, restart=restart)
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=30, slurm_job_id=theirs, slurm_restart_count=0)
    before = path.read_bytes()
    with pytest.raises(SaveDirectoryBusy) as err:
        SaveLock(str(tmp_path)).acquire()
    message = str(err.value)
    assert message.startswith(f"--save {tmp_path} is in use by pid 4321 on host node-a"), message
    assert "its heartbeat is 30 s old, within its lease of 600 s (the lock is taken over " \
           "once the lease lapses)" in message, message
    assert path.read_bytes() == before


def test_a_lapsed_lease_on_another_host_is_taken_over(tmp_path, slurm):
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=700)
    lock = SaveLock(str(tmp_path))
    warning = lock.acquire()
    assert warning.startswith("warning: took over the lock of pid 4321 on host node-a, started "
                              "then: its last heartbeat is 700 s old, "
                              "past its lease of 600 s"), warning
    assert json.load(open(path))["run_id"] == lock.run_id
    lock.release()


def test_an_earlier_versions_lock_on_another_host_holds(tmp_path, slurm):
    """No lease recorded: its holder does not refresh the file, so its age says nothing."""
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=10 ** 6, lease_s=..., slurm_job_id=..., slurm_restart_count=...)
    with pytest.raises(SaveDirectoryBusy, match="it runs on another host and its lock has no "
                                                "lease .an earlier version's, or an invalid one. "
                                                "to judge"):
        SaveLock(str(tmp_path)).acquire()


def test_a_live_holders_heartbeat_keeps_its_lock_and_a_stalled_one_loses_it(tmp_path, slurm,
                                                                            monkeypatch):
    monkeypatch.setenv(LEASE_ENV, "1")
    path = str(tmp_path / "out.lock")
    holder = WriterLock(path)
    assert holder.acquire() is None
    os.utime(path, (time.time() - 50, time.time() - 50))
    time.sleep(0.5)  # five heartbeats at lease/10
    assert time.time() - os.stat(path).st_mtime < 1.0  # refreshed
    import megatron_jreg.writer_lock as writer_lock
    here = socket.gethostname()
    monkeypatch.setattr(writer_lock.socket, "gethostname", lambda: "node-b")
    with pytest.raises(OutputBusy, match=r"within its lease of 1\.0 s"):
        WriterLock(path).acquire()
    # the holder stalls (a stopped process): its heartbeat stops and the lease lapses
    holder._stop.set()
    holder._beat.join()
    time.sleep(1.3)
    other = WriterLock(path)
    warning = other.acquire()
    assert f"pid {os.getpid()} on host {here}" in warning, warning
    assert re.search(r"its last heartbeat is 1\.\d s old, past its lease of 1\.0 s$",
                     warning), warning
    assert not holder.still_held() and other.still_held()
    holder.release()  # the stalled holder leaves the new holder's file alone
    assert os.path.exists(path) and other.still_held()
    other.release()
    assert not os.path.exists(path)


def test_save_lock_says_when_it_was_lost(tmp_path, slurm):
    lock = SaveLock(str(tmp_path))
    lock.acquire()
    assert lock.lost() is None
    write_record(tmp_path / "jreg_writer.lock", run_id="someone-else")
    assert lock.lost() == (
        f"--save {tmp_path}: this run no longer holds {tmp_path}/jreg_writer.lock (another run "
        "took it over after this run's heartbeat lapsed, or the file was removed); stopping "
        "without saving so that two runs never write one directory")
    lock.release()
    assert json.load(open(tmp_path / "jreg_writer.lock"))["run_id"] == "someone-else"


def test_a_lock_replaced_after_it_was_judged_goes_back(tmp_path, slurm):
    """Two processes take over one gone holder's lock: the slower one, finding a new holder's
    file where the gone one's was, puts it back and is refused."""
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=700)
    gone = json.load(open(path))
    write_record(path, host="node-c", run_id="new-holder")  # the faster one took it meanwhile
    slower = SaveLock(str(tmp_path))
    assert slower._move_aside(gone) is False
    assert json.load(open(path))["run_id"] == "new-holder"
    assert sorted(os.listdir(tmp_path)) == ["jreg_writer.lock"]


@pytest.mark.parametrize("value", ["abc", "0", "nan", "-5", "inf", "1e400", "1e300"])
def test_lease_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv(LEASE_ENV, value)
    with pytest.raises(InputError, match=f"{LEASE_ENV}={value!r}: give the lease in seconds, from "
                                         "1 to 1000000 .default 600."):
        lease_seconds()


def test_a_requeue_on_the_same_host_is_not_fooled_by_a_reused_pid(tmp_path, slurm):
    """The holder's pid now belongs to another live process (this one): the restart count
    still says the holder is gone."""
    slurm(job_id=4242, restart=2)
    write_record(tmp_path / "jreg_writer.lock", host=socket.gethostname(), pid=os.getpid(),
                 slurm_job_id="4242", slurm_restart_count=1)
    lock = SaveLock(str(tmp_path))
    warning = lock.acquire()
    assert "Slurm requeued job 4242 (this is restart 2, the holder ran as restart 1)" in warning
    lock.release()
    write_record(tmp_path / "jreg_writer.lock", host=socket.gethostname(), pid=os.getppid(),
                 slurm_job_id="4242", slurm_restart_count=2)
    with pytest.raises(SaveDirectoryBusy, match="its process is running on this host"):
        SaveLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("lease", [-5, 0.5, True, float("nan"), 1e999, "5"])
def test_a_lease_a_holder_cannot_have_is_no_lease(tmp_path, slurm, lease):
    """Negative, below a second, a boolean, NaN, infinite or a string: the record cannot be
    judged by its age, so an old one on another host holds."""
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=7200, lease_s=lease)
    with pytest.raises(SaveDirectoryBusy, match="its lock has no lease .an earlier version's, "
                                                "or an invalid one. to judge"):
        SaveLock(str(tmp_path)).acquire()


@pytest.mark.parametrize("content", [b"", b"[" * 3000 + b"]" * 3000, b"{" + b" " * 200000 + b"}"],
                         ids=["empty", "deep", "huge"])
def test_an_unreadable_lock_is_named_as_such(tmp_path, slurm, content):
    (tmp_path / "jreg_writer.lock").write_bytes(content)
    with pytest.raises(SaveDirectoryBusy, match="its lock file is empty or unreadable"):
        SaveLock(str(tmp_path)).acquire()


def test_a_lock_that_cannot_be_written_is_not_left_behind(tmp_path, slurm, monkeypatch):
    """A full disk between the create and the record: no empty lock stays to block later runs."""
    import megatron_jreg.writer_lock as writer_lock

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_lock.json, "dumps", full)
    with pytest.raises(OSError, match="No space left"):
        SaveLock(str(tmp_path)).acquire()
    assert os.listdir(tmp_path) == []


# ---- the same host: who the pid is ---------------------------------------------------------

def _here(**fields):
    """A record written on this host by an earlier version (no flock), with ``fields``."""
    return dict(dict(host=socket.gethostname(), pid=os.getppid()), **fields)


def test_a_record_naming_this_very_process_is_a_restart_with_the_same_pid(tmp_path, slurm):
    """Was: a container's trainer, pid 1 after every restart, found the dead holder's pid 1
    running (itself) and stopped for good: "its process is running on this host"."""
    write_record(tmp_path / "jreg_writer.lock", **_here(pid=os.getpid()))
    lock = SaveLock(str(tmp_path))
    assert lock.acquire().endswith(
        f": it names this very process (pid {os.getpid()}), which did not take it: a restart "
        f"that got the same pid (in {tmp_path})")
    lock.release()


@pytest.mark.parametrize("fields,reason", [
    ({"boot_id": "00000000-0000-0000-0000-000000000000"},
     "it ran before this host last started (another boot id)"),
    ({"start_ticks": 1}, f"pid {os.getppid()} now belongs to another process, started at "
                         "another time"),
], ids=["earlier-boot", "reused-pid"])
def test_a_live_pid_of_another_process_is_not_the_holder(tmp_path, slurm, fields, reason):
    """The holder's pid runs (this test's parent), but the record says it was another
    process: of an earlier boot, or started at another time."""
    write_record(tmp_path / "jreg_writer.lock", **_here(**fields))
    lock = SaveLock(str(tmp_path))
    assert lock.acquire().endswith(f": {reason} (in {tmp_path})")
    lock.release()


def test_the_same_pid_started_at_the_same_time_is_the_holder(tmp_path, slurm):
    from megatron_jreg.writer_lock import process_identity
    parent = process_identity()  # this process's boot and namespace; the parent's start below
    with open(f"/proc/{os.getppid()}/stat") as f:
        started = int(f.read().rsplit(")", 1)[1].split()[19])
    write_record(tmp_path / "jreg_writer.lock", **_here(
        boot_id=parent["boot_id"], pid_namespace=parent["pid_namespace"], start_ticks=started))
    with pytest.raises(SaveDirectoryBusy, match="its process is running on this host"):
        SaveLock(str(tmp_path)).acquire()


def test_a_pid_of_another_pid_namespace_without_an_flock_waits_for_its_lease(tmp_path, slurm):
    path = tmp_path / "jreg_writer.lock"
    write_record(path, age_s=30, **_here(pid=1, pid_namespace="pid:[1]"))
    with pytest.raises(SaveDirectoryBusy, match="its heartbeat is 30 s old, within its lease"):
        SaveLock(str(tmp_path)).acquire()
    write_record(path, age_s=700, **_here(pid=1, pid_namespace="pid:[1]"))
    lock = SaveLock(str(tmp_path))
    assert "past its lease of 600 s" in lock.acquire()
    lock.release()


HOLD = """
import sys, time
from megatron_jreg.writer_lock import WriterLock
lock = WriterLock(sys.argv[1])
assert lock.acquire() is None
print("held", flush=True)
time.sleep(600)
"""


def _unshare_works():
    import subprocess
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid` (root or user namespaces)")
def test_a_holder_in_another_pid_namespace_is_judged_by_its_flock(tmp_path, slurm):
    """pid 1 of another namespace holds the lock: its flock says it runs; once it is killed,
    the flock is gone and the lock is taken over at once."""
    import signal
    import subprocess
    import sys
    path = str(tmp_path / "out.lock")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c",
                               HOLD, path], stdout=subprocess.PIPE, text=True, env=env,
                              start_new_session=True)
    try:
        assert holder.stdout.readline() == "held\n"
        assert json.load(open(path))["pid"] == 1
        with pytest.raises(OutputBusy, match="its process is running on this host"):
            WriterLock(path).acquire()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait(timeout=60)
    from megatron_jreg.lock_holders import flock_free
    deadline = time.time() + 30  # the namespace's pid 1 may still be exiting after unshare
    while not flock_free(path) and time.time() < deadline:
        time.sleep(0.05)
    lock = WriterLock(path)
    warning = lock.acquire()
    assert warning.startswith("warning: took over the lock of pid 1 on host ") and warning.endswith(
        ": no process holds its lock file any more (it ended)"), warning
    lock.release()
    assert not os.path.exists(path)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_lock_that_is_not_a_regular_file_is_refused_without_waiting(tmp_path, slurm, kind):
    """Was: a FIFO as SAVE/jreg_writer.lock hung the trainer for good (the record was read
    with a blocking open)."""
    import multiprocessing
    path = tmp_path / "jreg_writer.lock"
    os.mkfifo(path) if kind == "fifo" else os.mkdir(path)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()

    def attempt():
        try:
            SaveLock(str(tmp_path)).acquire()
            queue.put("acquired")
        except Exception as err:  # noqa: BLE001 - the child reports what it got
            queue.put(str(err))
    child = ctx.Process(target=attempt)
    child.start()
    child.join(timeout=20)
    if child.is_alive():
        child.kill()
        pytest.fail("acquiring a lock whose file is a FIFO hung")
    message = queue.get(timeout=5)
    assert message.startswith(f"--save {tmp_path} is in use by an unknown run (unreadable "
                              "lock), its lock file is empty or unreadable"), message
    assert message.endswith(f"(if that run is gone, delete {path})"), message


def _boot_time():
    return float(next(line for line in open("/proc/stat") if line.startswith("btime ")).split()[1])


def test_an_earlier_versions_record_older_than_the_boot_is_gone(tmp_path, slurm):
    """A record without a start time or flock, naming pid 1 (alive: this host's init), taken
    before this host last started: its holder ran in an earlier boot."""
    write_record(tmp_path / "jreg_writer.lock",
                 **_here(pid=1, start_time="2001-01-01 00:00:00 UTC"))
    lock = SaveLock(str(tmp_path))
    assert lock.acquire().endswith(": it ran before this host last started (its lock is older "
                                   f"than the boot) (in {tmp_path})")
    lock.release()


def test_an_earlier_versions_record_older_than_its_pids_process_is_gone(tmp_path, slurm):
    """The record's pid runs, but that process started after the lock was taken: the pid was
    reused. Taken after that process started, the record is its own and holds."""
    import subprocess
    import sys
    now = time.time()
    if now - _boot_time() < 300:
        pytest.skip("this host booted less than 5 minutes ago")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        path = tmp_path / "jreg_writer.lock"
        before = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(now - 240))
        write_record(path, **_here(pid=live.pid, start_time=before))
        lock = SaveLock(str(tmp_path))
        assert lock.acquire().endswith(f": pid {live.pid} now belongs to another process, started "
                                       f"after the lock was taken (in {tmp_path})")
        lock.release()
        after = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time()))
        write_record(path, **_here(pid=live.pid, start_time=after))
        with pytest.raises(SaveDirectoryBusy, match="its process is running on this host"):
            SaveLock(str(tmp_path)).acquire()
    finally:
        live.kill()
        live.wait()
