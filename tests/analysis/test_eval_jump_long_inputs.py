"""eval_jump makes only the tokens it uses: a huge document costs what --max-tokens takes.

What the tests prove:
- on a 24 MB one-line text (and the same text as one JSONL record) with --max-tokens 1024,
  the model's tokenizer is given at most 64 K characters in all (the code before gave it
  all 24 M: 38 s and a 3.7 GB peak on 2 busy cores, against 2 s now), the run takes under
  12 s, and its Psi_l equal, exactly, those of the text cut by hand to its first 40 K
  characters;
- ``first_tokens`` returns exactly ``tokenize(text)[:n]`` for byte-level BPE tokenizers with
  GPT-2's and Llama 3's pre-tokenizer regexes, an end-of-text post-processor, SentencePiece
  BPE and unigram models and a word-level tokenizer, on text with runs of spaces, tabs,
  newlines, punctuation, digits and non-ASCII letters, while tokenizing only a prefix of it;
  a text with no space to cut at is tokenized whole;
- an indexed dataset's document of 2 M tokens is read only as far as the tokens used.
"""

from __future__ import annotations

import io
import json
import random
import time

import numpy as np
import pytest
from tiny_tokenizer import VOCAB_WORDS

from megatron_jreg.analysis import hf_source
from megatron_jreg.analysis.text_inputs import (
    MARGIN_TOKENS,
    first_tokens,
    read_indexed_dataset,
    token_sequences,
)
from megatron_jreg.commands.eval_jump import main

pytest.importorskip("transformers")

MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def huge_line() -> str:
    """24 MB of tiny-tokenizer words on one line (a 200 K-word block, repeated)."""
    rng = random.Random(3)
    block = " ".join(rng.choice(VOCAB_WORDS) for _ in range(200_000))
    return " ".join([block] * 31)


def _run(tmp_path, name, *args):
    out = tmp_path / f"{name}.json"
    rc = main([*map(str, args), "--max-tokens", str(MAX_TOKENS), "--json", str(out),
               "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["--text-file", "--jsonl"])
def test_huge_one_line_document_tokenizes_a_bounded_prefix(
    kind, huge_line, tiny_hf_model, tmp_path, monkeypatch
):
    def write(name, text):
        path = tmp_path / name
        path.write_text(json.dumps({"text": text}) + "\n" if kind == "--jsonl" else text + "\n")
        return path

    big = write("big", huge_line)
    assert big.stat().st_size > 24_000_000
    head = huge_line[: huge_line.index(" ", 40_000)]  # cut by hand at a word's end
    small = write("small", head)

    given = []
    tokenize = hf_source.HFCausalLMSource.tokenize

    def counting(self, text):
        given.append(len(text))
        return tokenize(self, text)

    monkeypatch.setattr(hf_source.HFCausalLMSource, "tokenize", counting)
    start = time.perf_counter()
    measured = _run(tmp_path, "big", "--hf-model", tiny_hf_model, kind, big)
    seconds = time.perf_counter() - start
    assert measured["tokens"] == MAX_TOKENS
    assert sum(given) <= 64 * 1024, given  # the old code tokenized all 24 M characters
    assert seconds < 12, seconds

    given.clear()
    by_hand = _run(tmp_path, "small", "--hf-model", tiny_hf_model, kind, small)
    assert by_hand["tokens"] == MAX_TOKENS
    assert measured["displacement"] == by_hand["displacement"]
    assert measured["jump_rate_by_layer"] == by_hand["jump_rate_by_layer"]


# ---- first_tokens against whole-text tokenization -------------------------------------------

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _messy_text(seed: int, words: int) -> str:
    """Words, digits, punctuation runs, runs of spaces, tabs and newlines, non-ASCII."""
    rng = random.Random(seed)
    pieces = ["the", "jump", "layer", "résumé", "naïve", "日本語", "über", "x", "12345", "7",
              "...", "!!", "--", "'s", "don't", "(a)", "a.b", "😀", "_id", "C++"]
    gaps = [" ", " ", " ", " ", "  ", "   ", "\t", "\n", "\n\n", " \n ", "\r\n"]
    return "".join(rng.choice(pieces) + rng.choice(gaps) for _ in range(words))


def _corpus():
    return [_messy_text(seed, 400) for seed in range(20)]


def _byte_bpe(split_regex=None, eos=False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    if split_regex is None:  # GPT-2's regex, inside ByteLevel
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    if eos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 1)])
    return lambda text: tok.encode(text).ids


def _sentencepiece(model_type):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=model, vocab_size=500,
        model_type=model_type, byte_fallback=True, minloglevel=2,
        remove_extra_whitespaces=False, normalization_rule_name="identity")
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    return lambda text: processor.encode(text, add_bos=True)


def _word_level(tiny_hf_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_hf_model)
    return lambda text: tok(text, add_special_tokens=True, verbose=False)["input_ids"]


@pytest.mark.parametrize("name", ["gpt2-regex", "llama3-regex", "with-eos", "spm-bpe",
                                  "spm-unigram", "word-level"])
def test_first_tokens_are_the_whole_texts_first_tokens(name, tiny_hf_model):
    tokenize = {
        "gpt2-regex": lambda: _byte_bpe(),
        "llama3-regex": lambda: _byte_bpe(LLAMA3_SPLIT),
        "with-eos": lambda: _byte_bpe(eos=True),
        "spm-bpe": lambda: _sentencepiece("bpe"),
        "spm-unigram": lambda: _sentencepiece("unigram"),
        "word-level": lambda: _word_level(tiny_hf_model),
    }[name]()
    given = []

    def counting(text):
        given.append(len(text))
        return tokenize(text)

    cut_short = 0
    for seed in range(30):
        if name == "word-level":
            rng = random.Random(seed)
            text = " ".join(rng.choice(VOCAB_WORDS + ["w1  w2", "w3\tw4", "w5\nw6"])
                            for _ in range(5000))
        else:
            text = _messy_text(100 + seed, 6000)
        whole = tokenize(text)
        for n in (1, 7, 100, 555, 2048):
            given.clear()
            assert first_tokens(counting, text, n) == whole[:n], (seed, n)
            cut_short += max(given) < len(text)
    assert cut_short >= 100  # most calls tokenized a prefix only


def test_text_without_a_space_to_cut_at_is_tokenized_whole():
    calls = []

    def tokenize(text):
        calls.append(len(text))
        return list(text.encode())

    text = "a" * 100_000
    assert first_tokens(tokenize, text, 10) == [97] * 10
    assert calls == [100_000]
    # one space far past the first estimate: the cut is there, with the margin kept
    text = "b" * 50_000 + " " + "c" * 50_000
    calls.clear()
    assert first_tokens(tokenize, text, 10) == [98] * 10
    assert calls == [50_000]
    # a token of 20 characters: the first prefix is short, and grows in proportion
    text = " ".join(["abcdefghijklmnopqrs"] * 100_000)

    def words(text):
        calls.append(len(text))
        return [len(w) for w in text.split(" ")]

    whole = words(text)
    calls.clear()
    assert first_tokens(words, text, 2000) == whole[:2000]
    first = (2000 + MARGIN_TOKENS) * 8
    assert len(calls) == 2 and first <= calls[0] < first + 20, calls
    assert (2000 + MARGIN_TOKENS) * 20 < calls[1] < (2000 + MARGIN_TOKENS) * 20 * 1.3, calls


def test_indexed_document_is_read_only_as_far_as_needed(tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 90, 3).astype(np.int32),
            rng.integers(0, 90, 2_000_000).astype(np.int32),  # two sentences of 1 M
            rng.integers(0, 90, 50).astype(np.int32)]
    prefix = str(tmp_path / "big_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(docs[0], [3])
    builder.add_document(docs[1], [1_000_000, 1_000_000])
    builder.add_document(docs[2], [50])
    builder.finalize(prefix + ".idx")

    read = []
    get = IndexedDataset.get

    def counting(self, idx, offset=0, length=None):
        out = get(self, idx, offset, length)
        read.append(len(out))
        return out

    monkeypatch.setattr(IndexedDataset, "get", counting)
    got = list(token_sequences(read_indexed_dataset(prefix), None, 2048, 100, 90))
    assert got == [docs[0].tolist(), docs[1][:97].tolist()]
    assert sum(read) == 100
    got = list(token_sequences(read_indexed_dataset(prefix), None, 1_500_000, None, 90))
    assert [len(g) for g in got] == [3, 1_500_000, 50]
    assert got[1] == docs[1][:1_500_000].tolist()
    assert got[2] == docs[2].tolist()
