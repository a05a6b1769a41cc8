"""examples/slurm/pretrain_3b_jreg.sbatch: run with stand-in `sbatch`, `srun`, `scontrol` and
`torchrun`, as the docs submit it; the trainer command it would start on each node is
parsed by the trainer's own parser and checked for 2 nodes x 8 GPUs before any work."""

import os
import re
import signal
import subprocess
import time

from test_launch_scripts import RECORDER, validated
from trainer_runs import REPO

from megatron_jreg.commands import flags as cli
from megatron_jreg.config.run import BUILDERS, SECTIONS

SCRIPT = os.path.join(REPO, "examples", "slurm", "pretrain_3b_jreg.sbatch")

# sbatch: run the script as Slurm would, in the submit directory, with the job's variables
SBATCH = """#!/bin/sh
printf '%s\\037' sbatch "$@" >> "$LAUNCH_LOG"; printf '\\n' >> "$LAUNCH_LOG"
export SLURM_SUBMIT_DIR="$PWD" SLURM_JOB_ID=4242 SLURM_JOB_NUM_NODES=2 SLURM_GPUS_PER_NODE=h100:8 \\
  SLURM_JOB_NODELIST='gpu-[07-08]'
exec bash "$1"
"""
# srun: record, then run the task once (node 0): every node runs the same command
SRUN = """#!/bin/sh
printf '%s\\037' srun "$@" >> "$LAUNCH_LOG"; printf '\\n' >> "$LAUNCH_LOG"
while [ "${1#-}" != "$1" ]; do shift; done
exec "$@"
"""
# srun that waits for USR1 (the time limit) and records that it got it
SRUN_WAITS = """#!/bin/bash
trap 'echo usr1 >> "$LAUNCH_LOG"; exit 0' USR1
echo started >> "$LAUNCH_LOG"
while :; do sleep 0.1; done
"""
SCONTROL = """#!/bin/sh
printf '%s\\037' scontrol "$@" >> "$LAUNCH_LOG"; printf '\\n' >> "$LAUNCH_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu-07\\ngpu-08\\n'; fi
"""


def stand_ins(tmp_path, srun=SRUN):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name, text in (("sbatch", SBATCH), ("srun", srun), ("scontrol", SCONTROL),
                       ("torchrun", RECORDER.format(name="torchrun")),
                       ("python", RECORDER.format(name="python"))):
        (bindir / name).write_text(text)
        (bindir / name).chmod(0o755)
    log = tmp_path / "launches.log"
    log.write_text("")
    return bindir, log


def env_for(tmp_path, bindir, log, data_prefix, **extra):
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", LAUNCH_LOG=str(log),
               DATA_PATH=data_prefix, TOKENIZER_MODEL="/models/tokenizer.model",
               RUN_DIR=str(tmp_path / "run"))
    for key in ("EXTRA_ARGS", "GPUS_PER_NODE", "NNODES", "MASTER_ADDR", "MASTER_PORT",
                "RDZV_ENDPOINT", "REPO"):
        env.pop(key, None)
    env.update(extra)
    return env


def calls(log):
    return [line.split("\037")[:-1] for line in log.read_text().splitlines() if "\037" in line]


def submit(tmp_path, data_prefix, **extra):
    bindir, log = stand_ins(tmp_path)
    proc = subprocess.run(["sbatch", "examples/slurm/pretrain_3b_jreg.sbatch"], cwd=REPO,
                          env=env_for(tmp_path, bindir, log, data_prefix, **extra),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return calls(log)


def test_sbatch_header_asks_for_two_nodes_a_task_each_requeue_and_a_warning_signal():
    lines = open(SCRIPT).read().splitlines()
    first_command = next(i for i, line in enumerate(lines) if line.strip()
                         and not line.startswith("#"))
    header = [line.split()[1] for line in lines[:first_command] if line.startswith("#SBATCH")]
    # sbatch reads #SBATCH lines only before the first command
    assert len(header) == sum(line.startswith("#SBATCH") for line in lines)
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--requeue",
            "--open-mode=append"} <= set(header)
    [warning] = [h for h in header if h.startswith("--signal=")]
    seconds = int(re.fullmatch(r"--signal=B:USR1@(\d+)", warning).group(1))
    assert seconds >= 300  # time for a 3B save before the kill


def test_each_node_runs_torchrun_with_c10d_rendezvous_and_a_valid_16_gpu_trainer(
        demo_data, tmp_path, monkeypatch):
    launched = submit(tmp_path, demo_data)
    srun = next(c for c in launched if c[0] == "srun")
    assert "--ntasks-per-node=1" in srun
    [torchrun] = [c for c in launched if c[0] == "torchrun"]
    cut = torchrun.index("-m")
    assert torchrun[1:cut] == ["--nnodes", "2", "--nproc_per_node", "8", "--rdzv_backend", "c10d",
                               "--rdzv_endpoint", "gpu-07:29500", "--rdzv_id", "4242"]
    argv = torchrun[cut + 2:]
    c = validated(argv, monkeypatch, world_size=16)
    assert c["model"].model_preset == "3b" and c["parallel"].tensor_model_parallel_size == 2
    assert c["training"].exit_signal == "SIGUSR1" and c["training"].exit_signal_handler
    assert c["checkpoint"].save == str(tmp_path / "run" / "checkpoints")
    assert c["checkpoint"].load is None  # nothing saved yet
    assert not [c for c in launched if c[0] == "scontrol" and c[1] == "requeue"]


def test_requeued_job_resumes_from_its_checkpoints(demo_data, tmp_path, monkeypatch):
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2000")
    launched = submit(tmp_path, demo_data, EXTRA_ARGS="--micro-batch-size 2")
    [torchrun] = [c for c in launched if c[0] == "torchrun"]
    c = validated(torchrun[torchrun.index("-m") + 2:], monkeypatch, world_size=16)
    assert c["checkpoint"].load == str(ckpt)
    assert c["training"].micro_batch_size == 2  # EXTRA_ARGS still override


def test_usr1_before_the_time_limit_reaches_the_trainer_and_requeues(demo_data, tmp_path):
    bindir, log = stand_ins(tmp_path, srun=SRUN_WAITS)
    env = env_for(tmp_path, bindir, log, demo_data, SLURM_SUBMIT_DIR=REPO, SLURM_JOB_ID="4242",
                  SLURM_JOB_NUM_NODES="2", SLURM_GPUS_PER_NODE="8",
                  SLURM_JOB_NODELIST="gpu-[07-08]")
    job = subprocess.Popen(["bash", SCRIPT], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while "started" not in log.read_text():
        assert time.time() < deadline and job.poll() is None
        time.sleep(0.05)
    job.send_signal(signal.SIGUSR1)  # what Slurm's --signal=B:USR1 does
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert "usr1" in log.read_text()  # srun got it (and forwards it to the tasks)
    assert ["scontrol", "requeue", "4242"] in calls(log)
    assert "the time limit is near" in out


def test_documented_submission_runs_as_written(tmp_path):
    """docs/megatron_lm_flags.md's sbatch command, as written (its paths need not exist: the
    stand-in torchrun only records the trainer command, which the trainer's parser takes)."""
    doc = open(os.path.join(REPO, "docs", "megatron_lm_flags.md")).read()
    [block] = [b.split("```", 1)[0] for b in doc.split("```bash\n")[1:]
               if "sbatch" in b.split("```")[0]]
    bindir, log = stand_ins(tmp_path)
    env = env_for(tmp_path, bindir, log, "unused")
    del env["DATA_PATH"], env["TOKENIZER_MODEL"]
    proc = subprocess.run(["bash", "-c", block], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    [torchrun] = [c for c in calls(log) if c[0] == "torchrun"]
    c = cli.parse(SECTIONS, torchrun[torchrun.index("-m") + 2:], build=BUILDERS)
    assert c["data"].data_path == ["/data/fineweb_edu_text_document"]
    assert c["data"].tokenizer_model == "/models/llama2/tokenizer.model"
