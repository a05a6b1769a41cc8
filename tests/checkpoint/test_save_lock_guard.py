"""The --save lock guards the whole run, and a restart whose pid is the dead holder's resumes.

What these tests prove:
- two runs on one --save never both save, whatever their timing: a run paused before it
  takes the lock, while another run saves there and ends, judges --save under the lock
  when it goes on: a fresh run is refused (the other run's iterations stay), a resume
  continues the other run's newest iteration, and a --use-checkpoint-args resume whose
  settings came from an older iteration is refused naming both;
- a run paused holding the lock keeps the other one out;
- a trainer killed in a pid namespace of its own (pid 1, as in a container) and restarted
  in a new one (pid 1 again) resumes, with one line saying whose lock it took over and why.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from trainer_runs import REPO, base_args, read_until, run_env, step_of, train

from megatron_jreg.checkpoint.dist_checkpoint import TRACKER, iteration_dir
from megatron_jreg.lock_holders import flock_free

COMMON = dict(train_iters=6, save_interval=2, lr_decay_iters=6)

# the trainer with a pause at a point of its start-up: it writes PAUSED_FILE there and goes
# on once GO_FILE exists
PAUSED = """
import os, sys, time
from megatron_jreg.training import checkpointing
from megatron_jreg.checkpoint import save_lock

def wait():
    open(os.environ["PAUSED_FILE"], "w").close()
    while not os.path.exists(os.environ["GO_FILE"]):
        time.sleep(0.05)

if os.environ["PAUSE_AT"] == "before_lock":
    take = checkpointing.Checkpointer.take_save_lock
    def paused(self):
        wait()
        return take(self)
    checkpointing.Checkpointer.take_save_lock = paused
else:
    acquire = save_lock.SaveLock.acquire
    def holding(self):
        warning = acquire(self)
        wait()
        return warning
    save_lock.SaveLock.acquire = holding

from megatron_jreg.commands.train import main
sys.exit(main(sys.argv[1:]))
"""


def _start_paused(argv, tmp_path, at):
    env = dict(run_env(), PAUSE_AT=at, PAUSED_FILE=str(tmp_path / "paused"),
               GO_FILE=str(tmp_path / "go"))
    proc = subprocess.Popen([sys.executable, "-c", PAUSED] + [str(a) for a in argv], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not os.path.exists(tmp_path / "paused"):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the paused run never reached its pause"
        time.sleep(0.05)
    return proc


def _go(proc, tmp_path):
    open(tmp_path / "go", "w").close()
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _shards(save, iteration):
    folder = iteration_dir(str(save), iteration)
    return {n: open(os.path.join(folder, n), "rb").read()
            for n in sorted(os.listdir(folder)) if n.endswith(".distcp")}


def test_a_fresh_run_paused_before_the_lock_is_refused_after_another_run_saved(
        demo_data, tmp_path):
    """Was: run B validated an empty --save, run A saved iterations 2 and 4 there and ended,
    and B then took the free lock, trained from scratch and saved iteration 2 over A's (the
    tracker back from 4 to 2, both rc 0)."""
    save = tmp_path / "save"
    b = _start_paused(base_args(demo_data, save=save, seed=2, **COMMON), tmp_path, "before_lock")
    train(base_args(demo_data, save=save, exit_interval=4, **COMMON))  # run A
    a_two = _shards(save, 2)
    rc, out, err = _go(b, tmp_path)
    assert rc == 2, out[-2000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"error: --save {save} already holds checkpoints (iter_0000002, iter_0000004, "
        f"{TRACKER}) and this run does not resume from them: pass --load {save} to continue "
        "that run, another --save for a new one, or --overwrite-checkpoints to replace them")
    assert "iteration " not in out
    assert open(save / TRACKER).read() == "4"
    assert _shards(save, 2) == a_two
    assert sorted(os.listdir(save)) == ["iter_0000002", "iter_0000004", TRACKER]


def test_a_resume_paused_before_the_lock_continues_the_newest_iteration(demo_data, tmp_path):
    """Was: the resume read iteration 2 before the pause, and after run A saved iteration 4
    it went on from 2 and saved its own iteration 4 over A's."""
    save = tmp_path / "save"
    train(base_args(demo_data, save=save, exit_interval=2, **COMMON))
    b = _start_paused(base_args(demo_data, load=save, save=save, **COMMON), tmp_path,
                      "before_lock")
    train(base_args(demo_data, load=save, save=save, exit_interval=4, **COMMON))  # run A
    rc, out, err = _go(b, tmp_path)
    assert rc == 0, out[-2000:] + err[-2000:]
    steps = [step_of(line) for line in out.splitlines() if step_of(line)]
    assert steps == [5, 6], out[-3000:]
    assert open(save / TRACKER).read() == "6"


def test_a_resume_whose_settings_came_from_an_older_iteration_is_refused(demo_data, tmp_path):
    """--use-checkpoint-args read iteration 2 at parse time; another run saved iteration 4
    before this one took the lock: the settings are not those of what it would load."""
    save = tmp_path / "save"
    train(base_args(demo_data, save=save, exit_interval=2, **COMMON))
    b = _start_paused(base_args(demo_data, load=save, save=save, use_checkpoint_args=True,
                                model_preset=None, **COMMON), tmp_path, "before_lock")
    train(base_args(demo_data, load=save, save=save, exit_interval=4, **COMMON))  # run A
    a_four = _shards(save, 4)
    rc, out, err = _go(b, tmp_path)
    assert rc == 2, out[-2000:] + err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"error: --load {save} changed while this run started: --use-checkpoint-args read "
        "iteration 2, and it now holds iteration 4 (another run saved it meanwhile); start this "
        "run again to continue from there")
    assert _shards(save, 4) == a_four and open(save / TRACKER).read() == "4"


def test_a_run_paused_holding_the_lock_keeps_another_out(demo_data, tmp_path):
    save = tmp_path / "save"
    b = _start_paused(base_args(demo_data, save=save, **COMMON), tmp_path, "holding_lock")
    other = train(base_args(demo_data, save=save, seed=2, **COMMON), check=False)
    assert other.returncode == 2, other.stderr[-2000:]
    assert f"error: --save {save} is in use by pid {b.pid} on host" in other.stderr
    assert "its process is running on this host" in other.stderr
    rc, out, err = _go(b, tmp_path)
    assert rc == 0, err[-2000:]
    assert open(save / TRACKER).read() == "6"


# ---- a restart in a new pid namespace ---------------------------------------------------------

def _unshare_works():
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--kill-child", "true"],
                              capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _in_new_pid_namespace(argv, **popen):
    cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m",
           "megatron_jreg.train"] + [str(a) for a in argv]
    return subprocess.Popen(cmd, cwd=REPO, env=run_env(), text=True, start_new_session=True,
                            **popen)


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare --pid` (root or user namespaces)")
def test_a_restart_in_a_new_pid_namespace_with_the_same_pid_resumes(demo_data, tmp_path):
    """Was: the restarted trainer, pid 1 again, found the dead holder's pid 1 alive (itself)
    and stopped: "is in use by pid 1 on host ..., its process is running on this host"."""
    save = tmp_path / "save"
    argv = base_args(demo_data, load=save, save=save, **COMMON)
    first = _in_new_pid_namespace(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    read_until(first, lambda line: step_of(line) == 3, lines, "iteration 3")
    os.killpg(first.pid, signal.SIGKILL)  # unshare, and pid 1 of the namespace with it
    first.wait(timeout=60)
    deadline = time.time() + 30  # the namespace's pid 1 may still be exiting after unshare
    while not flock_free(str(save / "jreg_writer.lock")) and time.time() < deadline:
        time.sleep(0.05)
    record = json.load(open(save / "jreg_writer.lock"))
    assert record["pid"] == 1 and record["flock"] is True, record
    assert open(save / TRACKER).read() == "2"
    restart = _in_new_pid_namespace(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = restart.communicate(timeout=300)
    assert restart.returncode == 0, out[-2000:] + err[-2000:]
    took = [line for line in (out + err).splitlines() if "took over" in line]
    assert len(took) == 1, took
    assert took[0].startswith("warning: took over the lock of pid 1 on host "), took
    assert took[0].endswith(
        f": no process holds its lock file any more (it ended) (in {save})"), took
    steps = [step_of(line) for line in out.splitlines() if step_of(line)]
    assert steps == [3, 4, 5, 6], out[-3000:]
    assert not os.path.exists(save / "jreg_writer.lock")
