"""convert_from_hf and convert_to_hf stopped by the OS while writing say so in one line:
the file (or, where the library that failed does not say which, the output), the cause and
the fix; exit 2, no traceback, and nothing left beside the output (its temporary directory
is removed).

Each failing writer is met for real: megatron-core's forked shard writers and torch's zip
writer of common.pt (convert_from_hf), the tokenizers and safetensors libraries (Rust:
"(os error 27)") and megatron-core's, under the file size limit (RLIMIT_FSIZE, as ``ulimit
-f`` sets it) and on a full tmpfs. Before, each was a traceback.
"""

import os

import pytest
from checkpoint_runs import run_env, run_tool

from write_limits import FULL, LIMIT_FIX, one_line, run_limited, tiny_disk

FROM, TO = "tools/convert_from_hf.py", "tools/convert_to_hf.py"


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_hf_model, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("ckpt") / "ckpt")
    run_tool("convert_from_hf.py", ["--hf-model", tiny_hf_model, "--save", save])
    return save


def _nothing_beside(output):
    parent = os.path.dirname(output)
    assert os.listdir(parent) == [], os.listdir(parent)


@pytest.mark.parametrize("limit,named", [(5_000, "/iter_0000000.partial-"),
                                         (1_000, ": ")],
                         ids=["shards", "tokenizer"])
def test_convert_from_hf_under_a_file_size_limit(tiny_hf_model, tmp_path, limit, named):
    """5000 bytes: a shard of megatron-core's forked writers, named; 1000: the tokenizer's
    files (tokenizers names no file: the output is named)."""
    save = str(tmp_path / "out" / "ckpt")
    proc = run_limited([FROM, "--hf-model", tiny_hf_model, "--save", save], run_env(), limit)
    line = one_line(proc, "convert_from_hf: error: cannot write ",
                    f"the file size limit (ulimit -f: {limit} bytes) " + LIMIT_FIX)
    assert (f"{save}: " if named == ": " else named) in line, line
    _nothing_beside(save)


@pytest.mark.parametrize("size", ["12k", "100k"], ids=["common_pt", "shards"])
def test_convert_from_hf_on_a_full_disk(tiny_hf_model, tmp_path, size):
    """12k: common.pt (torch's writer loses the error's number: what it left tells it);
    100k: a shard."""
    with tiny_disk(tmp_path / "disk", size) as disk:
        save = os.path.join(disk, "ckpt")
        proc = run_tool("convert_from_hf.py", ["--hf-model", tiny_hf_model, "--save", save],
                        check=False)
        one_line(proc, f"convert_from_hf: error: cannot write {disk}/", FULL)
        _nothing_beside(save)


def test_convert_to_hf_under_a_file_size_limit(tiny_ckpt, tmp_path):
    output = str(tmp_path / "out" / "hf")
    proc = run_limited([TO, "--load", tiny_ckpt, "--output", output], run_env(), 30_000)
    # safetensors names no file: the output is named
    one_line(proc, f"convert_to_hf: error: cannot write {output}: ",
             "the file size limit (ulimit -f: 30000 bytes) " + LIMIT_FIX)
    _nothing_beside(output)


def test_convert_to_hf_on_a_full_disk(tiny_ckpt, tmp_path):
    with tiny_disk(tmp_path / "disk", "100k") as disk:
        output = os.path.join(disk, "hf")
        proc = run_tool("convert_to_hf.py", ["--load", tiny_ckpt, "--output", output],
                        check=False)
        one_line(proc, f"convert_to_hf: error: cannot write {output}: ", FULL)
        _nothing_beside(output)
