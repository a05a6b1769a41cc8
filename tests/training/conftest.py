"""A small demo dataset (stdlib docstrings, byte tokenizer) and helpers to run the trainer."""

import json
import os
import subprocess
import sys

import forked_trainer
import pytest
from session_cache import build_once

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


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    return build_once(tmp_path_factory, "demo_data", _build_demo_data)


def _build_demo_data(root):
    corpus = root / "corpus.jsonl"
    prefix = root / "demo"
    for cmd in (
        [sys.executable, "tools/make_demo_corpus.py", "--output", str(corpus), "--max-mb", "0.6"],
        [sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(prefix), "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return str(prefix) + "_text_document"


@pytest.fixture(scope="session")
def demo_sp_data(tmp_path_factory):
    """The README demo's data: the whole demo corpus, a 2000-piece sentencepiece tokenizer."""
    return tuple(build_once(tmp_path_factory, "demo_sp_data", _build_demo_sp_data))


def _build_demo_sp_data(root):
    corpus, model_prefix, prefix = root / "corpus.jsonl", root / "tokenizer", root / "demo"
    for cmd in (
        [sys.executable, "tools/make_demo_corpus.py", "--output", str(corpus)],
        [sys.executable, "tools/train_tokenizer.py", "--input", str(corpus), "--model-prefix",
         str(model_prefix), "--vocab-size", "2000"],
        [sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(prefix), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
         str(model_prefix) + ".model", "--append-eod", "--workers", "2"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return str(prefix) + "_text_document", str(model_prefix) + ".model"


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory):
    """200 demo conversations (tools/make_demo_corpus.py --chat), byte tokenizer, as
    ``preprocess_data.py --sft`` writes them; returns the dataset prefix."""
    return build_once(tmp_path_factory, "sft_data", _build_sft_data)


def _build_sft_data(root):
    for cmd in (
        [sys.executable, "tools/make_demo_corpus.py", "--chat", "--output", str(root / "chat.jsonl"),
         "--max-docs", "200"],
        [sys.executable, "tools/preprocess_data.py", "--sft", "--input", str(root / "chat.jsonl"),
         "--output-prefix", str(root / "chat"), "--tokenizer-type", "ByteTokenizer", "--workers", "1"],
    ):
        proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return str(root / "chat_sft_document")


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
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def read_metrics(path):
    rows = [json.loads(line) for line in open(path)]
    return [r for r in rows if "lm_loss" in r]
