"""The data checked against the run before any work: token ids past the tokenizer's
vocabulary, a split with no documents (megatron-core would loop forever), and megatron's
index cache and the token-range cache keyed by the data's content, not its path."""

import os
import subprocess
import sys

import numpy
import pytest
from trainer_runs import REPO, base_args, run_env


def write_pair(prefix, docs, dtype=numpy.uint16):
    """A megatron-core .bin/.idx pair holding ``docs`` (lists of ids), one document each."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(torch.tensor(doc, dtype=torch.int64), [len(doc)])
    builder.finalize(prefix + ".idx")
    return prefix


def random_docs(n, length, high, seed=0):
    rng = numpy.random.default_rng(seed)
    return [rng.integers(0, high, length).tolist() for _ in range(n)]


def _trainer(argv, timeout):
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train"] + argv, cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


def _one_line_before_work(code, out, err, *parts):
    assert code == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert all(p in err for p in parts), err
    assert "lm loss" not in out  # no step ran


def test_token_ids_past_the_tokenizer_vocabulary_are_refused(tmp_path):
    """ByteTokenizer has 259 ids, padded to 384 embedding rows: ids up to 299 used to train
    silently in the padding rows (ids past 384: an IndexError traceback)."""
    prefix = write_pair(str(tmp_path / "wide"), random_docs(60, 40, 300))
    code, out, err = _trainer(base_args(prefix, train_iters=1, seq_length=32), timeout=300)
    largest = max(max(d) for d in random_docs(60, 40, 300))
    _one_line_before_work(code, out, err, repr(prefix), f"largest token id is {largest}",
                          "vocabulary of 259 ids", "tokenizer the data was built with")


def test_split_with_no_documents_is_refused_not_hung(tmp_path):
    """20 documents under --split 98,2,0: the validation split gets none, and megatron-core's
    GPTDataset._get_num_epochs used to add empty epochs forever."""
    prefix = write_pair(str(tmp_path / "twenty"), random_docs(20, 40, 250))
    argv = base_args(prefix, split="98,2,0", eval_interval=2, eval_iters=1, train_iters=2,
                     seq_length=32)
    try:
        code, out, err = _trainer(argv, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("the trainer hung on a split with no documents")
    _one_line_before_work(code, out, err, "--split 98,2,0 gives the validation split 0 of the 20 "
                          f"documents of --data-path {prefix!r}", "--eval-interval 0")


def _first_samples(prefix, cache_dir, n=4):
    from megatron_jreg.data.datasets.gpt import GPTDataConfig, build_gpt_datasets
    from megatron_jreg.data.tokenizers.build import build_tokenizer

    config = GPTDataConfig(data_path=[prefix], split="100,0,0", seq_length=16,
                           cache_dir=str(cache_dir))
    train, _, _ = build_gpt_datasets(config, build_tokenizer("ByteTokenizer"), 24)
    return [train[i]["tokens"].tolist() for i in range(n)]


def test_rebuilt_prefix_never_reads_a_stale_index_cache(tmp_path):
    """megatron-core keys its document/sample/shuffle indices by path and config: the same
    prefix rebuilt with other documents used to reuse the old indices (wrong samples)."""
    prefix = str(tmp_path / "data")
    write_pair(prefix, random_docs(30, 20, 250, seed=1))
    _first_samples(prefix, tmp_path / "cache")
    write_pair(prefix, random_docs(12, 57, 250, seed=2))  # rebuilt: other documents
    assert _first_samples(prefix, tmp_path / "cache") == _first_samples(prefix, tmp_path / "fresh")


def test_token_range_cache_is_keyed_by_content(tmp_path):
    from megatron_jreg.data.datasets.token_range import index_key, max_token_id

    prefix, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_pair(prefix, [[1, 7, 3], [200, 4]])
    assert max_token_id(prefix, cache) == 200
    assert len(os.listdir(cache)) == 1 and max_token_id(prefix, cache) == 200  # cached
    key = index_key(prefix)
    write_pair(prefix, [[1, 7, 3], [900, 4]])  # same lengths, same .idx: another .bin
    assert index_key(prefix) == key  # the index cache rightly stays (same documents)
    assert max_token_id(prefix, cache) == 900
    write_pair(prefix, [[5], [6, 1000, 2, 3]])  # other documents
    assert index_key(prefix) != key and max_token_id(prefix, cache) == 1000


WORKER = """
import sys
import torch.distributed as dist
from megatron_jreg.data.datasets.run_data_check import check_data_against_run
dist.init_process_group("gloo")
prefix, cache, out = sys.argv[1], sys.argv[2], sys.argv[3]
with open(f"{out}{dist.get_rank()}", "w") as f:
    try:
        check_data_against_run([prefix], 259, cache)
    except ValueError as err:
        f.write(f"{err}\\n")
    check_data_against_run([prefix], 300, cache)  # from the cache
    f.write("ok\\n")
dist.destroy_process_group()
"""


def test_two_ranks_share_the_pass_and_agree(tmp_path):
    """Under torchrun (gloo) the ranks scan a slice each and all raise the same one line."""
    prefix = write_pair(str(tmp_path / "wide"), random_docs(50, 33, 300))
    (tmp_path / "worker.py").write_text(WORKER)
    out = str(tmp_path / "rank")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(tmp_path / "worker.py"), prefix,
                           str(tmp_path / "cache"), out], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    largest = max(max(d) for d in random_docs(50, 33, 300))
    for rank in (0, 1):
        error, ok = open(f"{out}{rank}").read().splitlines()
        assert f"largest token id is {largest}" in error and ok == "ok", (error, ok)
    assert len(os.listdir(tmp_path / "cache")) == 1


def test_token_range_cache_sees_an_in_place_rewrite_with_the_mtime_put_back(tmp_path):
    # Same size, same inode, mtime restored with os.utime: only the ctime tells (the kernel
    # sets it on every write and utime cannot put it back).
    from megatron_jreg.data.datasets.token_range import max_token_id

    prefix, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_pair(prefix, [[1, 7, 3], [200, 4]])
    assert max_token_id(prefix, cache) == 200
    st = os.stat(prefix + ".bin")
    tokens = numpy.fromfile(prefix + ".bin", dtype=numpy.uint16)
    tokens[tokens == 200] = 900
    with open(prefix + ".bin", "r+b") as f:  # in place: the inode stays
        f.write(tokens.tobytes())
    os.utime(prefix + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(prefix + ".bin")
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (st.st_size, st.st_ino,
                                                                 st.st_mtime_ns)
    assert max_token_id(prefix, cache) == 900


def test_a_cache_record_not_written_for_this_content_is_not_trusted(tmp_path):
    """A record filed under the right name but without its key (written by hand, or by
    another program) was served: a forged max of 3 over ids near 900 (an IndexError later)."""
    import json

    from megatron_jreg.data.datasets.token_range import _cache_path, max_token_id

    prefix, cache = str(tmp_path / "d"), str(tmp_path / "cache")
    write_pair(prefix, random_docs(5, 50, 900))
    real = max_token_id(prefix, cache)
    assert real == int(numpy.fromfile(prefix + ".bin", numpy.uint16).max()) > 3
    with open(_cache_path(prefix, cache), "w") as f:
        json.dump({"max_token_id": 3, "prefix": prefix}, f)
    assert max_token_id(prefix, cache) == real


def test_a_pickle_in_megatrons_index_cache_runs_nothing(tmp_path):
    """megatron-core reads its index cache with numpy.load(allow_pickle=True), which
    unpickles a file that is not a .npy: one swapped for a pickle that runs ``touch MARKER``
    (a cache handed over with the data) is refused naming it, and nothing runs."""
    from crafted_checkpoints import command_prefix

    prefix = write_pair(str(tmp_path / "data"), random_docs(60, 40, 250))
    argv = base_args(prefix, train_iters=1, seq_length=32)
    code, out, err = _trainer(argv, timeout=300)
    assert code == 0, err[-3000:]
    cached = sorted((tmp_path / "index-cache").glob("*-train-document_index.npy"))
    assert len(cached) == 1, os.listdir(tmp_path / "index-cache")
    marker = tmp_path / "MARKER"
    cached[0].write_bytes(b"\x80\x04" + command_prefix(marker) + b"N.")
    code, out, err = _trainer(argv, timeout=300)
    assert not marker.exists(), "the pickle in the cache ran its command"
    _one_line_before_work(code, out, err, f"{cached[0]}: refused to load: not a numpy array "
                          "file", "delete it", "--data-cache-path")
