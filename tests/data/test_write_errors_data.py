"""Preprocessing that the OS stops writing says so in one line naming the file, the cause
and the fix, exit 2, no traceback, and leaves nothing beside its inputs.

The file size limit is set as a shell's ``ulimit -f`` sets it (Python ignores SIGXFSZ, so
the write fails with EFBIG); with ``--partitions`` the write that fails is a partition
process's, and the parent reports it. Before, both were tracebacks (``RuntimeError:
OSError: [Errno 27] File too large`` from a partition). A real full tmpfs gives the line of
test_preprocess_disk_full (it was one line already).
"""

import os
import subprocess

import pytest
from preprocess_helpers import make_documents, output_files, write_jsonl

from write_limits import LIMIT_FIX, REPO, one_line, run_limited, tiny_disk


def _env():
    return dict(os.environ, PYTHONPATH=REPO, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(600, seed=3)])


def _argv(corpus, prefix, partitions):
    return ["tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
            "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "2",
            "--chunk-bytes", "4096", "--partitions", str(partitions)]


def test_a_plain_ulimit_is_one_line(corpus, tmp_path):
    """What a user sees after ``ulimit -f`` in a shell (1024-byte blocks)."""
    prefix = str(tmp_path / "out")
    command = " ".join(["ulimit -f 40; exec python", *_argv(corpus, prefix, 1)])
    proc = subprocess.run(["bash", "-c", command], cwd=REPO, env=_env(), text=True,
                          capture_output=True, timeout=300)
    one_line(proc, f"error: cannot write {prefix}_text_document.bin",
             "the file size limit (ulimit -f: 40960 bytes) " + LIMIT_FIX)
    assert output_files(tmp_path) == []


def test_a_limit_met_in_a_partition_process_is_one_line(corpus, tmp_path):
    prefix = str(tmp_path / "out")
    proc = run_limited(_argv(corpus, prefix, 2), _env(), limit=20_000)
    one_line(proc, f"error: cannot write {prefix}_partitions",
             "the file size limit (ulimit -f: 20000 bytes) " + LIMIT_FIX)
    assert output_files(tmp_path) == []


def test_a_full_tmpfs_is_one_line(corpus, tmp_path):
    with tiny_disk(tmp_path / "disk", "64k") as disk:
        prefix = os.path.join(disk, "out")
        proc = run_limited(_argv(corpus, prefix, 1), _env())
        one_line(proc, "error: no space left writing ", disk,
                 "free space or pick another --output-prefix")
        assert os.listdir(disk) == []
