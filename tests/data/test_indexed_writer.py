"""Our ``.bin``/``.idx`` writer against megatron-core's own: the same bytes, read back equal.

The writer never imports megatron-core; these tests do, to pin it: for each case the same
sequences go through megatron-core's ``IndexedDatasetBuilder`` and the files must match byte
for byte, and megatron-core's ``IndexedDataset`` must read ours back equal. Cases cover both
token dtypes (uint16 and int32 vocabularies), the SFT uint8 loss mask, documents of several
sequences (``--split-sentences``), merging (``--partitions``) and an empty dataset.
"""

import filecmp
import os
import subprocess
import sys

import numpy
import pytest
from preprocess_helpers import make_documents, write_jsonl

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.data.preprocess.writer import DTYPE_CODES, IndexedDatasetWriter
from megatron_jreg.data.tokenizers.build import build_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def documents(seed, dtype, count=40):
    """Documents as lists of sequences (1-3 each, some empty), ids that fill ``dtype``."""
    rng = numpy.random.default_rng(seed)
    high = min(numpy.iinfo(dtype).max, 200_000)
    return [[rng.integers(0, high, rng.integers(0, 30)).astype(dtype)
             for _ in range(rng.integers(1, 4))] for _ in range(count)]


def write_ours(prefix, dtype, docs):
    writer = IndexedDatasetWriter(prefix + ".bin", dtype, prefix + ".spill")
    for start in range(0, len(docs), 7):  # several documents per call, as a worker sends them
        batch = docs[start:start + 7]
        sequences = [s for doc in batch for s in doc]
        writer.add_encoded(
            numpy.concatenate(sequences) if sequences else numpy.zeros(0, dtype),
            numpy.array([len(s) for s in sequences], numpy.int32),
            numpy.array([len(doc) for doc in batch], numpy.int32))
    writer.finalize(prefix + ".idx")


def write_megatron(prefix, dtype, docs):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs:
        builder.add_document(numpy.concatenate(doc), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


def assert_same_files(a, b):
    for ext in (".bin", ".idx"):
        assert filecmp.cmp(a + ext, b + ext, shallow=False), f"{a}{ext} differs from {b}{ext}"


def megatron_reads(prefix):
    """(sequences, document boundaries, dtype) as megatron-core's reader sees them."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.document_indices.tolist(), ds.index.dtype


def assert_megatron_rewrites_it(prefix, tmp_path):
    """megatron-core reads ``prefix`` and, given what it read, writes the same bytes."""
    sequences, boundaries, dtype = megatron_reads(prefix)
    docs = [[numpy.array(s, dtype) for s in sequences[a:b]]
            for a, b in zip(boundaries, boundaries[1:])]
    write_megatron(str(tmp_path / "again"), dtype, docs)
    assert_same_files(prefix, str(tmp_path / "again"))
    return sequences, boundaries, dtype


def test_dtype_codes_are_megatron_cores():
    from megatron.core.datasets.indexed_dataset import DType

    assert {d.value: numpy.dtype(getattr(numpy, d.name)) for d in DType} == {
        code: numpy.dtype(dtype) for code, dtype in DTYPE_CODES.items()}


@pytest.mark.parametrize("dtype", [numpy.uint16, numpy.int32, numpy.uint8])
def test_same_bytes_as_megatron_and_read_back_equal(tmp_path, dtype):
    docs = documents(0, dtype)
    write_ours(str(tmp_path / "ours"), dtype, docs)
    write_megatron(str(tmp_path / "stock"), dtype, docs)
    assert_same_files(str(tmp_path / "ours"), str(tmp_path / "stock"))
    sequences, boundaries, read_dtype = megatron_reads(str(tmp_path / "ours"))
    assert sequences == [s.tolist() for doc in docs for s in doc]
    assert boundaries == numpy.cumsum([0] + [len(doc) for doc in docs]).tolist()
    assert read_dtype == dtype
    assert not list(tmp_path.glob("*.spill*"))


def test_merging_matches_megatrons_add_index(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    parts = [str(tmp_path / f"part{i}") for i in range(3)]
    for i, part in enumerate(parts):  # the middle part is empty, as a partition can be
        write_ours(part, numpy.uint16, documents(i + 1, numpy.uint16) if i != 1 else [])
    ours = IndexedDatasetWriter(str(tmp_path / "ours.bin"), numpy.uint16, str(tmp_path / "s"))
    stock = IndexedDatasetBuilder(str(tmp_path / "stock.bin"), dtype=numpy.uint16)
    for part in parts:
        ours.add_index(part)
        stock.add_index(part)
    ours.finalize(str(tmp_path / "ours.idx"))
    stock.finalize(str(tmp_path / "stock.idx"))
    assert_same_files(str(tmp_path / "ours"), str(tmp_path / "stock"))
    with pytest.raises(ValueError, match="holds uint16 tokens, this dataset int32"):
        IndexedDatasetWriter(str(tmp_path / "x.bin"), numpy.int32,
                             str(tmp_path / "x")).add_index(parts[0])


def test_empty_dataset_matches_megatron(tmp_path):
    write_ours(str(tmp_path / "ours"), numpy.uint16, [])
    write_megatron(str(tmp_path / "stock"), numpy.uint16, [])
    assert_same_files(str(tmp_path / "ours"), str(tmp_path / "stock"))


@pytest.mark.parametrize("vocab_size,dtype", [(None, numpy.uint16), (70_000, numpy.int32)])
def test_tool_output_is_megatrons_for_both_token_dtypes(tmp_path, vocab_size, dtype):
    docs = make_documents(80, seed=7)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    size = [] if vocab_size is None else ["--vocab-size", str(vocab_size)]
    prefix = str(tmp_path / "out")
    assert main(["--input", data, "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer",
                 *size, "--append-eod", "--workers", "2", "--chunk-bytes", "600"]) == 0
    sequences, boundaries, read_dtype = assert_megatron_rewrites_it(prefix + "_text_document",
                                                                   tmp_path)
    tok = build_tokenizer("ByteTokenizer", vocab_size=vocab_size)
    assert sequences == [tok.encode(t) + [tok.eod] for t in docs]
    assert boundaries == list(range(len(docs) + 1)) and read_dtype == dtype


@pytest.mark.parametrize("tokenizer_args", ["SentencePieceTokenizer", "HuggingFaceTokenizer"],
                         indirect=True)
def test_tool_output_is_megatrons_for_library_tokenizers(tmp_path, tokenizer_args):
    flags, kwargs = tokenizer_args
    docs = make_documents(80, seed=8)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    prefix = str(tmp_path / "out")
    assert main(["--input", data, "--output-prefix", prefix, *flags, "--append-eod",
                 "--workers", "2", "--partitions", "2", "--chunk-bytes", "600"]) == 0
    sequences, _, _ = assert_megatron_rewrites_it(prefix + "_text_document", tmp_path)
    tok = build_tokenizer(**kwargs)
    assert sequences == [tok.encode(t) + [tok.eod] for t in docs]


def test_sft_tokens_and_uint8_mask_are_megatrons(tmp_path, capsys):
    from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, write_demo_corpus

    chat = str(tmp_path / "chat.jsonl")
    write_demo_corpus(DemoCorpusConfig(output=chat, chat=True, max_docs=60))
    prefix = str(tmp_path / "out")
    assert main(["--sft", "--input", chat, "--output-prefix", prefix, "--tokenizer-type",
                 "ByteTokenizer", "--workers", "2", "--chunk-bytes", "2048"]) == 0
    ds = SFTDataset(prefix + "_sft_document")
    for name, dtype, field in (("", numpy.uint16, "tokens"), ("_loss_mask", numpy.uint8,
                                                             "loss_mask")):
        sequences, _, read_dtype = assert_megatron_rewrites_it(
            f"{prefix}_sft_document{name}", tmp_path)
        assert read_dtype == dtype
        assert sequences == [ds[i][field].tolist() for i in range(len(ds))]


# Runs the tool as its command line does, with every worker checking its own modules after
# each chunk (forked workers find this function in the inherited __main__), then the parent.
_NO_HEAVY_IMPORTS = """
import sys
FORBIDDEN = ("torch", "megatron", "transformers")
def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
import megatron_jreg.data.preprocess.pipeline as preprocess
original = preprocess.encode_chunk_in_worker
def checked_encode(chunk):
    result = original(chunk)
    if heavy():
        raise RuntimeError(f"a worker imported {heavy()[:5]}")
    return result
preprocess.encode_chunk_in_worker = checked_encode
sys.argv = sys.argv[1:]
code = 0
try:  # not runpy: it swaps out __main__, where the workers look for checked_encode
    exec(compile(open(sys.argv[0]).read(), sys.argv[0], "exec"),
         {"__name__": "__main__", "__file__": sys.argv[0]})
except SystemExit as e:
    code = e.code
if heavy():
    sys.exit(f"the tool imported {heavy()[:5]}")
sys.exit(code)
"""


@pytest.mark.parametrize("case", ["byte", "sentencepiece", "hf-partitions", "sft-hf"])
def test_the_tool_imports_neither_torch_nor_megatron(tmp_path, case, sp_model,
                                                     hf_tokenizer_json):
    docs = make_documents(30, seed=9)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in docs])
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
        for t in docs])
    flags = {
        "byte": ["--input", data, "--tokenizer-type", "ByteTokenizer", "--append-eod"],
        "sentencepiece": ["--input", data, "--tokenizer-type", "SentencePieceTokenizer",
                          "--tokenizer-model", sp_model, "--append-eod"],
        "hf-partitions": ["--input", data, "--tokenizer-type", "HuggingFaceTokenizer",
                          "--tokenizer-model", hf_tokenizer_json, "--partitions", "2"],
        "sft-hf": ["--sft", "--input", chat, "--tokenizer-type", "HuggingFaceTokenizer",
                   "--tokenizer-model", hf_tokenizer_json],
    }[case]
    tool = os.path.join(REPO, "tools", "preprocess_data.py")
    proc = subprocess.run(
        [sys.executable, "-c", _NO_HEAVY_IMPORTS, tool, *flags, "--output-prefix",
         str(tmp_path / "out"), "--workers", "2", "--chunk-bytes", "500"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout
