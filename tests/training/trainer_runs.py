"""Helpers to run the trainer in the training tests: the subprocess environment, the flags
of a tiny run, the run itself, its metrics."""

import json
import os
import subprocess
import sys
import time

import forked_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_env():
    # PYTHONPATH: subprocesses import this checkout's package, whatever is installed
    # MEGATRON_JREG_DEVICE=cpu: gloo on the CPU also on a machine with GPUs (two ranks on
    # one GPU would not be the layouts these tests mean)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO,
               MEGATRON_JREG_DEVICE="cpu")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run_tool_ok(cmd):
    """One of tools/ (``cmd``: script and flags), which must succeed."""
    proc = forked_trainer.run_tool(cmd[0], cmd[1:], run_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def build_demo_data(root):
    """The training tests' small demo dataset (byte tokenizer) under ``root``; its prefix."""
    corpus = root / "corpus.jsonl"
    prefix = root / "demo"
    for cmd in (
        ["tools/make_demo_corpus.py", "--output", str(corpus), "--max-mb", "0.6"],
        ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(prefix), "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"],
    ):
        run_tool_ok(cmd)
    return str(prefix) + "_text_document"


def base_args(data_prefix, **overrides):
    """Flags of a tiny fp32 run on the demo data; overrides use flag names without dashes."""
    args = {
        "model-preset": "tiny", "seq-length": 64, "data-path": data_prefix,
        "tokenizer-type": "ByteTokenizer", "micro-batch-size": 4, "global-batch-size": 8,
        "train-iters": 6, "log-interval": 1, "eval-interval": 0, "lr": 3e-3,
        "lr-warmup-iters": 0, "jreg-lambda": 1.0, "jreg-alpha": 1.0, "seed": 1234,
    }
    args.update({k.replace("_", "-"): v for k, v in overrides.items()})
    argv = []
    for key, value in args.items():
        if value is None:
            continue
        if value is True:
            argv.append(f"--{key}")
        else:
            argv += [f"--{key}", str(value)]
    return argv


def train(argv, nproc=1, timeout=600, check=True):
    """``python -m megatron_jreg.train`` (under torchrun for ``nproc`` > 1); a single-rank
    run is forked from a process that has imported the trainer (tests/forked_trainer.py)."""
    if nproc == 1:
        proc = forked_trainer.run(argv, REPO, run_env(), timeout)
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc_per_node", str(nproc)]
        proc = subprocess.run(launcher + ["-m", "megatron_jreg.train"] + argv, cwd=REPO,
                              env=run_env(), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError("trainer failed "
                             f"({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def start_trainer(argv, nproc=1, **popen):
    """``python -m megatron_jreg.train`` (under torchrun for ``nproc`` > 1) left running, its
    output read line by line (stderr into stdout unless ``popen`` says otherwise)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    return subprocess.Popen(launcher + ["-m", "megatron_jreg.train"] + [str(a) for a in argv],
                            cwd=REPO, env=run_env(), **popen)


def read_until(proc, predicate, lines, what):
    """Read ``proc``'s output into ``lines`` up to the first line ``predicate`` accepts (which
    is returned); fails naming ``what`` when the run ends first, or after 300 s."""
    deadline = time.time() + 300
    for line in proc.stdout:
        lines.append(line)
        if predicate(line):
            return line
        assert time.time() < deadline, "".join(lines[-20:])
    raise AssertionError(f"the run ended before {what}:\n{''.join(lines[-30:])}")


def step_of(line):
    """The iteration a log line reports (0 for any other line)."""
    return int(line.split()[1].split("/")[0]) if line.startswith("iteration") else 0


def read_metrics(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if "lm_loss" in r]


def rank_pids(launcher_pid):
    """{RANK: pid} of the worker processes torchrun started."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = int(entry)
    return pids
