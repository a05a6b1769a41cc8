"""The data tools check their outputs before reading any input: a missing parent directory
is made and the run succeeds; an unwritable one is one line naming the flag, exit 2,
and nothing read or written."""

import os
import subprocess
import sys

import pytest

from unwritable import unwritable_dir

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tool(script, *argv):
    return subprocess.run([sys.executable, f"tools/{script}", *map(str, argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def refused(proc, flag, path):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and f"{flag} {path}" in lines[0], lines
    assert proc.stdout == ""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "new" / "dir" / "c.jsonl"
    proc = tool("make_demo_corpus.py", "--output", path, "--max-docs", "300")
    assert proc.returncode == 0, proc.stderr  # the missing parents were made
    return path


def test_make_demo_corpus(corpus, tmp_path):
    assert len(corpus.read_text().splitlines()) == 300
    bad = f"{unwritable_dir(tmp_path)}/missing/c.jsonl"
    refused(tool("make_demo_corpus.py", "--output", bad, "--max-docs", "5"), "--output", bad)


def test_train_tokenizer(corpus, tmp_path):
    prefix = tmp_path / "tok" / "deep" / "sp"
    proc = tool("train_tokenizer.py", "--input", corpus, "--model-prefix", prefix,
                "--vocab-size", "1000")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.exists(f"{prefix}.model")
    bad = f"{unwritable_dir(tmp_path)}/sp"
    proc = tool("train_tokenizer.py", "--input", corpus, "--model-prefix", bad, "--vocab-size",
                "1000")
    refused(proc, "--model-prefix", f"{bad}.model")


def test_train_tokenizer_too_small_a_vocabulary_is_one_line(corpus, tmp_path):
    proc = tool("train_tokenizer.py", "--input", corpus, "--model-prefix", tmp_path / "sp",
                "--vocab-size", "310")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, lines
    assert "--vocab-size 310: too small" in lines[0], lines
    assert not os.path.exists(tmp_path / "sp.model")


def test_preprocess_data(corpus, tmp_path):
    prefix = tmp_path / "data" / "deep" / "demo"
    proc = tool("preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
                "--tokenizer-type", "ByteTokenizer", "--append-eod")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert os.path.exists(f"{prefix}_text_document.idx")
    for bad in (f"{unwritable_dir(tmp_path)}/demo", f"{unwritable_dir(tmp_path)}/missing/demo"):
        proc = tool("preprocess_data.py", "--input", corpus, "--output-prefix", bad,
                    "--tokenizer-type", "ByteTokenizer", "--append-eod")
        refused(proc, "--output-prefix", bad)
