"""Tiny trainer runs with checkpoints, and runs of the tools that read them.

Megatron's process group stays out of the pytest process: everything that loads a
checkpoint runs in a process of its own (single-rank trainer and tool runs are forked from
a process that has imported the trainer: tests/forked_trainer.py).
"""

import json
import os
import subprocess
import sys

import forked_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
SEQ = 48  # evaluation documents are exactly this many bytes: no padding anywhere
ITERS = 3


def run_env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run(cmd, timeout=300, check=True):
    proc = subprocess.run(
        cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=timeout
    )
    if check:
        succeeded(proc)
    return proc


def run_tool(script, argv, timeout=300, check=True, env=None):
    """``python tools/SCRIPT *argv``, forked from a process that has imported the trainer
    (tests/forked_trainer.py)."""
    proc = forked_trainer.run_tool(f"tools/{script}", argv, env or run_env(), timeout=timeout)
    if check:
        succeeded(proc)
    return proc


def succeeded(proc):
    """``proc``, or an AssertionError with the ends of its output when it failed."""
    if proc.returncode != 0:
        raise AssertionError(
            f"{proc.args[:4]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
            f"{proc.stderr[-4000:]}"
        )
    return proc


def make_dataset(root):
    """A small byte-tokenized indexed dataset; returns its prefix."""
    corpus, prefix = os.path.join(root, "corpus.jsonl"), os.path.join(root, "demo")
    run_tool("make_demo_corpus.py", ["--output", corpus, "--max-docs", "80"])
    run_tool(
        "preprocess_data.py",
        [
            "--input",
            corpus,
            "--output-prefix",
            prefix,
            "--tokenizer-type",
            "ByteTokenizer",
            "--append-eod",
            "--workers",
            "1",
        ],
    )
    return prefix + "_text_document"


def train(data_prefix, save, nproc=1, save_interval=None, **layout):
    """ITERS steps of the tiny model, seed 1234, --vocab-size 512 (equal padding at TP1/TP2)."""
    args = {
        "model-preset": "tiny",
        "seq-length": 64,
        "data-path": data_prefix,
        "tokenizer-type": "ByteTokenizer",
        "micro-batch-size": 4,
        "global-batch-size": 8,
        "train-iters": ITERS,
        "log-interval": ITERS,
        "eval-interval": 0,
        "lr": 3e-3,
        "lr-warmup-iters": 1,
        "jreg-lambda": 1.0,
        "seed": 1234,
        "vocab-size": 512,
        "save": save,
        "save-interval": save_interval,
    }
    args.update({k.replace("_", "-"): v for k, v in layout.items()})
    argv = [x for k, v in args.items() if v is not None for x in (f"--{k}", str(v))]
    if nproc == 1:  # forked from a process that has imported the trainer
        succeeded(forked_trainer.run(argv, REPO, run_env(), 600))
    else:
        run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(nproc), "-m", "megatron_jreg.train"] + argv, timeout=600)
    return save


def eval_jump(argv, out_json):
    """tools/eval_jump.py in a process of its own; returns (stdout, the JSON report(s))."""
    proc = run_tool("eval_jump.py", [*argv, "--json", out_json, "--no-progress"])
    with open(out_json) as f:
        return proc.stdout, json.load(f)


def reference(tokens_file, out_file, roots):
    """checkpoint_worker.py: the trainer's own Psi_l and logits for each checkpoint."""
    import torch

    run(
        [
            sys.executable,
            os.path.join(HERE, "checkpoint_worker.py"),
            str(tokens_file),
            str(out_file),
            *map(str, roots),
        ]
    )
    return torch.load(out_file)
