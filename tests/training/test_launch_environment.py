"""The launchers' environment: CUDA_DEVICE_MAX_CONNECTIONS=1 (megatron-core's tensor- and
sequence-parallel overlap needs it, as Megatron-LM's scripts set), unless the user set it."""

import os
import subprocess

from test_slurm_script import env_for, stand_ins
from trainer_runs import REPO

# torchrun stand-in that records the variable the trainer processes would see
TORCHRUN = """#!/bin/sh
echo "CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS-unset}" >> "$LAUNCH_LOG"
"""


def sourced(**env):
    full = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    full.update(GPUS_PER_NODE="1", **env)
    proc = subprocess.run(["bash", "-c", 'source examples/launch_common.sh; '
                           'bash -c \'echo "${CUDA_DEVICE_MAX_CONNECTIONS-unset}"\''],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_launch_common_exports_one_connection_unless_set():
    assert sourced() == "1"  # exported: the launched processes see it
    assert sourced(CUDA_DEVICE_MAX_CONNECTIONS="8") == "8"


def test_slurm_job_gives_the_trainer_one_connection(demo_data, tmp_path):
    bindir, log = stand_ins(tmp_path)
    (bindir / "torchrun").write_text(TORCHRUN)
    for given, seen in ((None, "1"), ("4", "4")):
        log.write_text("")
        env = env_for(tmp_path, bindir, log, demo_data)
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
        if given:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = given
        proc = subprocess.run(["sbatch", "examples/slurm/pretrain_3b_jreg.sbatch"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert f"CUDA_DEVICE_MAX_CONNECTIONS={seen}" in log.read_text().splitlines()


def test_load_args_counts_whole_iterations_only(tmp_path):
    """A save killed half-way (iter_0000002.partial-PID-HEX, whose name ends in a digit)
    made the rerun pass --load to a directory with no whole iteration (exit 2)."""
    def load_args(root):
        proc = subprocess.run(["bash", "-c", f"source examples/launch_common.sh; load_args {root}"],
                              cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    (tmp_path / "iter_0000002.partial-12140-49f87032").mkdir()
    assert load_args(tmp_path) == []
    whole = tmp_path / "iter_0000002"
    whole.mkdir()
    assert load_args(tmp_path) == []  # renamed only once complete: no marker, not whole
    (whole / "jreg_complete.json").write_text("{}")
    assert load_args(tmp_path) == ["--load", str(tmp_path)]
