"""Round trips through megatron-core's readers, determinism across workers/partitions, and
the GPTDataset the trainer will use."""

import filecmp
import gzip
import json

import numpy
import pytest
import torch
from preprocess_helpers import make_documents, write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.tokenizers.build import build_tokenizer

KINDS = ["ByteTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"]


def read_documents(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def run(tmp_path, inputs, tokenizer_flags, *extra, name="out"):
    prefix = str(tmp_path / name)
    argv = ["--input", *inputs, "--output-prefix", prefix, *tokenizer_flags, *extra]
    assert main(argv) == 0
    return prefix


@pytest.mark.parametrize("tokenizer_args", KINDS, indirect=True)
def test_round_trip_each_tokenizer(tmp_path, tokenizer_args):
    flags, kwargs = tokenizer_args
    docs = make_documents(60)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t, "id": i} for i, t in enumerate(docs)])
    prefix = run(tmp_path, [data], flags, "--append-eod", "--workers", "2", "--chunk-bytes", "512")
    tok = build_tokenizer(**kwargs)
    got, ds = read_documents(prefix + "_text_document")
    assert got == [tok.encode(t) + [tok.eod] for t in docs]
    assert ds.index.dtype == numpy.uint16
    assert len(ds.document_indices) == len(docs) + 1


def test_workers_and_partitions_give_identical_bytes(tmp_path):
    docs = make_documents(400, seed=1)
    # Two files so partitions both split a file and cross a file boundary.
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in docs[:250]])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in docs[250:]])
    flags = ["--tokenizer-type", "ByteTokenizer", "--append-eod", "--chunk-bytes", "700"]
    outs = [
        run(tmp_path, [a, b], flags, "--workers", "1", name="w1"),
        run(tmp_path, [a, b], flags, "--workers", "2", name="w2"),
        run(tmp_path, [a, b], flags, "--workers", "2", "--partitions", "2", name="p2"),
        run(tmp_path, [a, b], flags, "--workers", "1", "--partitions", "3", name="p3"),
    ]
    for other in outs[1:]:
        for ext in (".bin", ".idx"):
            assert filecmp.cmp(outs[0] + "_text_document" + ext, other + "_text_document" + ext,
                               shallow=False), other
    assert not [p for p in tmp_path.iterdir() if "tmp" in p.name]


def test_json_keys_text_gzip_directory_and_glob(tmp_path):
    docs = make_documents(20, seed=2)
    records = [{"text": t, "title": t[:20]} for t in docs]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    flags = ["--tokenizer-type", "ByteTokenizer", "--append-eod"]
    prefix = run(tmp_path, [data], flags, "--json-keys", "text", "title", name="keys")
    tok = build_tokenizer("ByteTokenizer")
    for key in ("text", "title"):
        got, _ = read_documents(f"{prefix}_{key}_document")
        assert got == [tok.encode(r[key]) + [tok.eod] for r in records]

    sub = tmp_path / "in"
    sub.mkdir()
    with gzip.open(sub / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records[10:])
    write_jsonl(sub / "a.jsonl", records[:10])
    expected = [tok.encode(t) + [tok.eod] for t in docs]
    for inputs, name in (([str(sub)], "dir"), ([str(sub / "*.jsonl*")], "glob")):
        got, _ = read_documents(run(tmp_path, inputs, flags, name=name) + "_text_document")
        assert got == expected, name

    text = tmp_path / "plain.txt"
    text.write_text("".join(t + "\n" for t in docs), encoding="utf-8")
    got, _ = read_documents(
        run(tmp_path, [str(text)], flags, "--input-format", "text", name="txt") + "_text_document"
    )
    assert got == expected


@pytest.mark.parametrize("tokenizer_args", ["SentencePieceTokenizer"], indirect=True)
def test_gpt_dataset_batches(tmp_path, tokenizer_args):
    from megatron_jreg.data.datasets.gpt import GPTDataConfig, build_gpt_datasets

    flags, kwargs = tokenizer_args
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in make_documents(200, seed=3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in make_documents(100, seed=4)])
    pa = run(tmp_path, [a], flags, "--append-eod", name="a") + "_text_document"
    pb = run(tmp_path, [b], flags, "--append-eod", name="b") + "_text_document"
    tok = build_tokenizer(**kwargs)
    # an earlier in-process test may have left a world of one; building must not start one
    was_initialized = torch.distributed.is_initialized()
    for data_path in ([pa], ["0.7", pa, "0.3", pb]):
        config = GPTDataConfig(data_path=data_path, split="90,8,2", seq_length=32,
                               cache_dir=str(tmp_path / "cache"), eod_mask_loss=True)
        train, valid, test = build_gpt_datasets(config, tok, 64, 8, 4)
        assert len(train) >= 64 and len(valid) >= 8
        batch = next(iter(torch.utils.data.DataLoader(train, batch_size=4)))
        assert batch["tokens"].shape == (4, 32) and batch["labels"].shape == (4, 32)
        assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
        # eod_mask_loss: no loss on predicting from an EOD position
        assert (batch["loss_mask"][batch["tokens"] == tok.eod] == 0).all()
    assert torch.distributed.is_initialized() == was_initialized

    with pytest.raises(FileNotFoundError, match="preprocess_data.py"):
        build_gpt_datasets(GPTDataConfig(data_path=[str(tmp_path / "none")]), tok, 8)


def test_index_cache_is_built_under_the_cache_lock(tmp_path):
    """A second run on the same data waits while another holds the index cache's lock
    (megatron-core writes the cache in place; a reader must not see a half-written file)."""
    import fcntl
    import threading

    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401 (imported
    import megatron.core.datasets.gpt_dataset  # noqa: F401  here, not inside the wait below)

    from megatron_jreg.data.datasets.gpt import GPTDataConfig, build_gpt_datasets

    docs = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in make_documents(50, seed=5)])
    prefix = run(tmp_path, [docs], ["--tokenizer-type", "ByteTokenizer"], "--append-eod", name="a")
    cache = tmp_path / "cache"
    cache.mkdir()
    config = GPTDataConfig(data_path=[prefix + "_text_document"], split="100,0,0", seq_length=16,
                           cache_dir=str(cache))
    built = []
    worker = threading.Thread(target=lambda: built.append(
        build_gpt_datasets(config, build_tokenizer("ByteTokenizer"), 16)))
    with open(cache / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run building the same cache
        worker.start()
        worker.join(timeout=3.0)
        assert worker.is_alive() and not list(cache.glob("*.npy")), "built while the lock was held"
    worker.join(timeout=120)
    assert not worker.is_alive() and len(built[0][0]) >= 16
    assert list(cache.glob("*.npy"))
