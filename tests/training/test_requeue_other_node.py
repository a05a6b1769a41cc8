"""A Slurm requeue after a node failure: a 2-rank run SIGKILLed as a whole (no cleanup, its
lock left behind) restarts under another host name as the same job's next restart, takes the
lock over with one line, and resumes exactly. A run whose lock another run took over stops
before it writes."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

from trainer_runs import (
    REPO,
    base_args,
    read_metrics,
    read_until,
    run_env,
    start_trainer,
    step_of,
    train,
)

from megatron_jreg.checkpoint.dist_checkpoint import TRACKER

# the requeued job's node: its training ranks name another host (torchrun's agent keeps the
# real name, which its rendezvous resolves)
OTHER_HOST = """import os, socket
if "RANK" in os.environ:
    socket.gethostname = lambda: "node-b"
"""


def process_tree(root):
    """``root`` and every process below it (torchrun starts its ranks in sessions of their
    own, so a process group does not hold them)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]),
                                    []).append(int(entry))
        except OSError:
            continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def torchrun(argv):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "megatron_jreg.train"] + argv


def test_requeue_on_another_host_takes_over_the_lock_and_resumes_exactly(demo_data, tmp_path):
    # 200 steps planned, so the kill lands long before the end; the runs compared stop at 12
    common = dict(train_iters=200, save_interval=4, use_distributed_optimizer=True)
    full = tmp_path / "full.jsonl"
    train(base_args(demo_data, metrics_file=full, save=tmp_path / "a", exit_interval=12, **common),
          nproc=2)

    ckpt, part = tmp_path / "b", tmp_path / "part.jsonl"
    env = dict(run_env(), SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="0", PYTHONUNBUFFERED="1")
    first = subprocess.Popen(torchrun(base_args(demo_data, metrics_file=part, save=ckpt, **common)),
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines, deadline = [], time.time() + 300
    try:
        for line in first.stdout:
            lines.append(line)
            if line.startswith("saved checkpoint") and "iter_0000004" in line:
                break  # the node dies: every process at once, nothing cleaned up
            assert time.time() < deadline, "".join(lines[-20:])
    finally:
        for pid in process_tree(first.pid):
            os.kill(pid, signal.SIGKILL)
        first.communicate(timeout=60)
    holder = json.load(open(ckpt / "jreg_writer.lock"))
    assert (holder["host"], holder["slurm_job_id"], holder["slurm_restart_count"]) == (
        socket.gethostname(), "4242", 0)
    saved = int(open(ckpt / TRACKER).read())
    assert 4 <= saved < 12, saved  # above 4 only if the kill came after the next save

    site = tmp_path / "node_b"
    site.mkdir()
    (site / "sitecustomize.py").write_text(OTHER_HOST)
    env = dict(env, SLURM_RESTART_COUNT="1", PYTHONPATH=f"{site}:{REPO}")
    rows_before = [r for r in read_metrics(part) if r["iteration"] <= saved]
    os.replace(part, tmp_path / "killed.jsonl")
    with open(part, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows_before)
    second = subprocess.run(
        torchrun(base_args(demo_data, metrics_file=part, save=ckpt, load=ckpt, exit_interval=12,
                           **common)),
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    took = [line for line in second.stdout.splitlines() if "took over the lock" in line]
    assert took == [f"warning: took over the lock of pid {holder['pid']} on host "
                    f"{socket.gethostname()}, Slurm job 4242 restart 0, started "
                    f"{holder['start_time']}: Slurm requeued job 4242 (this is restart 1, the "
                    f"holder ran as restart 0) (in {ckpt})"], second.stdout[-3000:]
    assert f"loaded checkpoint {ckpt} iteration {saved}" in second.stdout
    a, b = read_metrics(full), read_metrics(part)
    assert [r["iteration"] for r in b] == list(range(1, 13))
    for x, y in zip(a, b):
        assert (y["lm_loss"], y["psi"], y["lr"]) == (x["lm_loss"], x["psi"],
                                                     x["lr"]), x["iteration"]
    assert not (ckpt / "jreg_writer.lock").exists()  # released at exit
    assert int(open(ckpt / TRACKER).read()) == 12


def test_a_run_that_lost_its_lock_stops_before_saving(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = base_args(demo_data, train_iters=100000, save=ckpt, save_interval=3, seq_length=32)
    run = start_trainer(argv, stderr=subprocess.PIPE)
    try:
        read_until(run, lambda line: step_of(line) >= 1, [], "step 1")
        # another run took the lock over (this one's heartbeat lapsed while it was stopped)
        lock = ckpt / "jreg_writer.lock"
        record = dict(json.load(open(lock)), host="node-c", pid=99, run_id="99-other")
        lock.with_suffix(".new").write_text(json.dumps(record))
        os.replace(lock.with_suffix(".new"), lock)
        _, err = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 2, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"error: --save {ckpt}: this run no longer holds {lock} (another run took it over after "
        "this run's heartbeat lapsed, or the file was removed); stopping without saving so that "
        "two runs never write one directory")
    assert [n for n in os.listdir(ckpt) if n.startswith("iter_")] == []
    assert json.load(open(lock))["run_id"] == "99-other"  # the other run's file is left alone
