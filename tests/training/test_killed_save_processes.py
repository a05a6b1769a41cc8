"""A trainer SIGKILLed during a save leaves no process behind.

megatron-core writes each save's files in processes it forks (one per file), for
synchronous saves in the trainer itself and for --async-save in the trainer's writer
process. Before platform/checkpoint_writers.py, a trainer killed while they wrote left them
running as orphans (3 of 10 kills: blocked for ever on a queue only the trainer fed). The
test makes the kill land while a writer is alive, every time: it stops one writer with
SIGSTOP once it has started writing (the writer names itself ckpt-file right after it asks
to die with its parent), kills the trainer alone with SIGKILL (not its process group), and
checks that every process the run had started is gone within seconds. A stopped process
can only be ended by SIGKILL, so a writer not bound to the trainer's life stays: the test
then fails, on every run.
"""

import os
import signal
import threading
import time

import pytest
from trainer_runs import base_args, read_until, start_trainer, step_of

from megatron_jreg.platform.checkpoint_writers import WRITER_NAME

ASYNC = dict(async_save=True, use_persistent_ckpt_worker=True)
# a model whose save takes a while on a CPU (a writer lives long enough to be caught)
SLOW_SAVE = dict(hidden_size=256, ffn_hidden_size=768, num_attention_heads=4)


def _children(pid):
    """The pids of ``pid``'s children (forked by any of its threads)."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _alive(pid):
    """Running (a zombie has exited: only its reaper is late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _catch_a_writer(trainer, seen, deadline):
    """Stop (SIGSTOP) a writer of a save while it writes, and return its pid; ``seen``
    collects every process of the run met on the way. A writer is a process forked during a
    save: the trainer's child (synchronous saves) or its writer process's child (--async-save).
    One named ckpt-file has asked to die with its parent; without that name in the first
    20 s (the code before the fix never names it), any writer found alive is stopped (the
    async run's own ckpt-writer and ckpt-results processes are not writers of a file)."""
    named = WRITER_NAME.decode()
    fallback_after = time.time() + 20
    while time.time() < deadline:
        level = _children(trainer)
        writers = level + [grandchild for child in level for grandchild in _children(child)]
        seen.update(writers)
        for pid in writers:
            comm = _comm(pid)
            if comm == named or (time.time() > fallback_after
                                 and comm not in (None, "ckpt-writer", "ckpt-results")):
                os.kill(pid, signal.SIGSTOP)
                if _alive(pid):
                    return pid
    raise AssertionError("no writer process caught during a save")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_trainer_killed_during_a_save_takes_its_writers_with_it(demo_data, tmp_path, kind):
    flags = dict(SLOW_SAVE, **(ASYNC if kind == "async" else {}))
    proc = start_trainer(base_args(demo_data, train_iters=100000, save=tmp_path / "ckpt",
                                   save_interval=1, seq_length=32, **flags))
    seen, stopped = set(), None
    try:
        read_until(proc, lambda l: step_of(l) >= 1, [], "step 1")
        # its output read on, so that it never waits on a full pipe
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        stopped = _catch_a_writer(proc.pid, seen, time.time() + 240)
        seen.update(_children(proc.pid))  # the async writer and results processes too
        proc.kill()  # SIGKILL to the trainer alone: nothing of ours runs after it
        proc.wait(timeout=60)
        deadline = time.time() + 10
        while [p for p in seen if _alive(p)] and time.time() < deadline:
            time.sleep(0.1)
        left = {p: _comm(p) for p in seen if _alive(p)}
        assert not left, f"processes of the killed run still alive: {left} (stopped {stopped})"
    finally:
        proc.kill()
        for pid in seen:  # what the assertion found, so that no test leaves them behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
