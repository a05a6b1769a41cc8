"""The training tests' shared data, built once per run: a small demo dataset (stdlib
docstrings, byte tokenizer), the README demo's data, SFT chat data. The helpers that run the
trainer are in trainer_runs.py."""

import pytest
from trainer_runs import build_demo_data
from trainer_runs import run_tool_ok as _tool

from session_cache import build_once


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    return build_once(tmp_path_factory, "demo_data", build_demo_data)


@pytest.fixture(scope="session")
def demo_sp_data(tmp_path_factory):
    """The README demo's data: the whole demo corpus, a 2000-piece sentencepiece tokenizer."""
    return tuple(build_once(tmp_path_factory, "demo_sp_data", _build_demo_sp_data))


def _build_demo_sp_data(root):
    corpus, model_prefix, prefix = root / "corpus.jsonl", root / "tokenizer", root / "demo"
    for cmd in (
        ["tools/make_demo_corpus.py", "--output", str(corpus)],
        ["tools/train_tokenizer.py", "--input", str(corpus), "--model-prefix",
         str(model_prefix), "--vocab-size", "2000"],
        ["tools/preprocess_data.py", "--input", str(corpus), "--output-prefix",
         str(prefix), "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
         str(model_prefix) + ".model", "--append-eod", "--workers", "2"],
    ):
        _tool(cmd)
    return str(prefix) + "_text_document", str(model_prefix) + ".model"


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory):
    """200 demo conversations (tools/make_demo_corpus.py --chat), byte tokenizer, as
    ``preprocess_data.py --sft`` writes them; returns the dataset prefix."""
    return build_once(tmp_path_factory, "sft_data", _build_sft_data)


def _build_sft_data(root):
    for cmd in (
        ["tools/make_demo_corpus.py", "--chat", "--output", str(root / "chat.jsonl"),
         "--max-docs", "200"],
        ["tools/preprocess_data.py", "--sft", "--input", str(root / "chat.jsonl"),
         "--output-prefix", str(root / "chat"), "--tokenizer-type", "ByteTokenizer", "--workers",
         "1"],
    ):
        _tool(cmd)
    return str(root / "chat_sft_document")
