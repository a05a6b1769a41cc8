"""A ``.bin`` that does not belong to its ``.idx`` is refused before training reads a token.

Before the check, a bigger ``.bin`` trained with exit 0 on the wrong tokens, a shorter one
failed deep in megatron-core naming no file, and 1,000 bytes short trained fine.
"""

import os
import shutil
import subprocess
import sys

import pytest
from preprocess_helpers import make_documents, write_jsonl

from megatron_jreg.commands.preprocess import main as preprocess
from megatron_jreg.data.datasets import gpt as gpt_datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(tmp_path, name, n_docs, seed=0):
    docs = [{"text": t} for t in make_documents(n_docs, seed)]
    data = write_jsonl(tmp_path / f"{name}.jsonl", docs)
    prefix = str(tmp_path / name)
    assert preprocess(["--input", data, "--output-prefix", prefix, "--tokenizer-type",
                       "ByteTokenizer", "--append-eod"]) == 0
    return prefix + "_text_document"


@pytest.fixture
def pair(tmp_path):
    return build(tmp_path, "a", 200)


def test_good_pair_passes(pair):
    gpt_datasets.check_indexed_dataset(pair)


@pytest.mark.parametrize("change", ["bigger", "shorter", "1000 bytes short", "one byte more"])
def test_bin_of_the_wrong_size_is_refused(pair, change):
    bin_path = pair + ".bin"
    size = os.path.getsize(bin_path)
    if change == "bigger":
        with open(bin_path, "ab") as f:
            f.write(b"\0" * 4096)
    elif change == "shorter":
        os.truncate(bin_path, size // 2)
    elif change == "1000 bytes short":
        os.truncate(bin_path, size - 1000)
    else:
        with open(bin_path, "ab") as f:
            f.write(b"\0")
    with pytest.raises(ValueError) as e:
        gpt_datasets.check_indexed_dataset(pair)
    message = str(e.value)
    assert "\n" not in message
    assert bin_path in message and pair + ".idx" in message, message
    assert str(os.path.getsize(bin_path)) in message and str(size) in message, message
    assert "tools/preprocess_data.py" in message


def test_idx_of_another_dataset_is_refused(tmp_path, pair):
    other = build(tmp_path, "b", 120, seed=1)
    shutil.copyfile(other + ".idx", pair + ".idx")
    with pytest.raises(ValueError, match="tools/preprocess_data.py") as e:
        gpt_datasets.check_indexed_dataset(pair)
    assert pair + ".bin" in str(e.value) and pair + ".idx" in str(e.value)


@pytest.mark.parametrize("damage", ["not an index", "truncated index", "missing bin"])
def test_unreadable_index_is_refused(pair, damage):
    idx = pair + ".idx"
    if damage == "not an index":
        with open(idx, "wb") as f:
            f.write(b"hello, I am not an index file at all" * 4)
    elif damage == "truncated index":
        os.truncate(idx, os.path.getsize(idx) - 16)
    else:
        os.unlink(pair + ".bin")
    with pytest.raises(ValueError) as e:
        gpt_datasets.check_indexed_dataset(pair)
    assert pair in str(e.value) and "\n" not in str(e.value), e.value


def test_empty_dataset_is_refused(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    prefix = str(tmp_path / "e")
    # --allow-empty exists for exactly this: an empty dataset that the trainer then refuses.
    assert preprocess(["--input", str(empty), "--output-prefix", prefix, "--tokenizer-type",
                       "ByteTokenizer", "--allow-empty"]) == 0
    with pytest.raises(ValueError, match="no tokens") as e:
        gpt_datasets.check_indexed_dataset(prefix + "_text_document")
    assert prefix + "_text_document" in str(e.value)


def test_build_gpt_datasets_checks_every_prefix(tmp_path, pair):
    from megatron_jreg.data.datasets.gpt import GPTDataConfig, build_gpt_datasets
    from megatron_jreg.data.tokenizers.build import ByteTokenizer

    other = build(tmp_path, "b", 120, seed=1)
    with open(other + ".bin", "ab") as f:
        f.write(b"\0" * 10)
    config = GPTDataConfig(data_path=["0.5", pair, "0.5", other], seq_length=32,
                           cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError) as e:
        build_gpt_datasets(config, ByteTokenizer(), 16, 16, 16)
    assert other + ".bin" in str(e.value)
    assert not os.path.exists(tmp_path / "cache") or os.listdir(tmp_path / "cache") == []


def _train(data_prefix, cache_dir):
    """A tiny fp32 CPU run (the flags of tests/training's ``base_args``)."""
    argv = ["--model-preset", "tiny", "--seq-length", "64", "--data-path", data_prefix,
            "--tokenizer-type", "ByteTokenizer", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--train-iters", "2", "--log-interval", "1",
            "--eval-interval", "0", "--lr", "3e-3", "--lr-warmup-iters", "0",
            "--jreg-lambda", "1.0", "--jreg-alpha", "1.0", "--data-cache-path", cache_dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "megatron_jreg.train", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_trainer_refuses_a_mismatched_pair(tmp_path):
    """End to end: exit 2 and the last line of stderr names both files."""
    prefix = build(tmp_path, "a", 300)
    other = build(tmp_path, "b", 100, seed=1)
    shutil.copyfile(other + ".idx", prefix + ".idx")  # a .bin bigger than its index says
    proc = _train(prefix, str(tmp_path / "cache"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and prefix + ".bin" in last and prefix + ".idx" in last, last
