"""The README pipeline: make_demo_corpus -> train_tokenizer -> preprocess_data, no download."""

import json
import os
import runpy

import pytest

from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, write_demo_corpus

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")


def tool_main(name):
    return runpy.run_path(os.path.join(TOOLS, name), run_name="not_main")["main"]


def test_demo_corpus_is_deterministic_and_real_text(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert write_demo_corpus(DemoCorpusConfig(output=str(a), max_docs=150))[0] == 150
    write_demo_corpus(DemoCorpusConfig(output=str(b), max_docs=150))
    assert a.read_bytes() == b.read_bytes()
    docs = [json.loads(line) for line in a.read_text().splitlines()]
    texts = [d["text"] for d in docs]
    assert len(set(texts)) == len(texts) and all(len(t) >= 200 for t in texts)
    assert sum(" the " in t for t in texts) > 100  # English prose, not code
    docs_mb, nbytes = write_demo_corpus(DemoCorpusConfig(output=str(b), max_mb=0.05,
                                                         overwrite=True))
    assert 0.05e6 <= nbytes < 0.1e6
    with pytest.raises(ValueError, match="--max-docs"):
        DemoCorpusConfig(output=str(b), max_docs=0)


def test_demo_pipeline_end_to_end(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_jreg.commands.preprocess import main as preprocess_main
    from megatron_jreg.data.tokenizers.build import build_tokenizer

    corpus = str(tmp_path / "demo.jsonl")
    assert tool_main("make_demo_corpus.py")(["--output", corpus, "--max-docs", "400"]) == 0
    prefix = str(tmp_path / "tok")
    assert tool_main("train_tokenizer.py")(
        ["--input", corpus, "--model-prefix", prefix, "--vocab-size", "1000"]) == 0
    out = str(tmp_path / "demo")
    assert preprocess_main(["--input", corpus, "--output-prefix", out, "--tokenizer-type",
                            "GPTSentencePieceTokenizer", "--tokenizer-model", prefix + ".model",
                            "--workers", "2", "--append-eod"]) == 0
    assert "done: 400 documents" in capsys.readouterr().out
    tok = build_tokenizer("GPTSentencePieceTokenizer", prefix + ".model")
    assert tok.vocab_size == 1000 and tok.eod == 2
    ds = IndexedDataset(out + "_text_document")
    first = json.loads(open(corpus).readline())["text"]
    assert len(ds) == 400 and ds[0].tolist() == tok.encode(first) + [tok.eod]
    assert tok.decode(ds[0].tolist()[:-1]) == first
