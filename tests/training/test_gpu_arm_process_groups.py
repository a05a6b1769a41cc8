"""The optimizer and megatron's process groups agree on every device: the trainer trains
with its process-group setup in the GPU arm (tests/training/gpu_arm_trainer.py), at one
rank and at DP 2 and CP 2 with the distributed optimizer, and its losses equal the plain CPU run's.

Before the groups were created on every device, this failed at the optimizer's build with
megatron's "Intra partial data parallel group is not initialized", as every GPU run did."""

import os
import subprocess
import sys

import pytest
from trainer_runs import REPO, base_args, read_metrics, run_env, train

WORKER = os.path.join(REPO, "tests", "training", "gpu_arm_trainer.py")


def gpu_arm_train(argv, nproc):
    cmd = [sys.executable, WORKER] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(nproc), WORKER]
    proc = subprocess.run(cmd + argv, cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.parametrize("nproc,flags", [
    (1, []), (2, ["--use-distributed-optimizer"]),
    (2, ["--use-distributed-optimizer", "--context-parallel-size", "2"])],
    ids=["one_rank", "dp2_distributed_optimizer", "cp2_distributed_optimizer"])
def test_trainer_trains_with_the_gpu_process_group_setup(demo_data, tmp_path, nproc, flags):
    runs = {}
    for arm in ("gpu_arm", "cpu"):
        metrics = tmp_path / f"{arm}.jsonl"
        argv = base_args(demo_data, train_iters=3, metrics_file=str(metrics)) + flags
        if arm == "gpu_arm":
            gpu_arm_train(argv, nproc)
        else:
            train(argv, nproc=nproc)
        runs[arm] = [(r["iteration"], r["lm_loss"], r["grad_norm"]) for r in read_metrics(metrics)]
    assert [step for step, _, _ in runs["cpu"]] == [1, 2, 3]
    assert runs["gpu_arm"] == runs["cpu"]  # the same run, bit for bit
