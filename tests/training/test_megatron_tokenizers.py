"""Megatron-LM's tokenizer types (megatron_jreg/data/tokenizers/megatron_lm.py): Llama2Tokenizer,
GPT2BPETokenizer (checked against transformers' GPT-2 tokenizers built from the same files)
and NullTokenizer, as Megatron-LM 0.16 defines them, and the trainer taking them by name."""

import json

import pytest
from trainer_runs import base_args, train

from megatron_jreg.data.tokenizers.megatron_lm import (
    GPT2BPETokenizer,
    Llama2Tokenizer,
    NullTokenizer,
    build_megatron_tokenizer,
)

TEXTS = ["Hello world, hello  tokenizer!", "  leading spaces and\ttabs\nnew lines",
         "numbers 12345 and 3.14; unicode: naïve café – ok", "'s 't 're contractions don't", ""]


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A small GPT-2 style vocab.json/merges.txt (byte-level BPE), trained offline."""
    from tokenizers import ByteLevelBPETokenizer

    root = tmp_path_factory.mktemp("gpt2")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50))
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=400, min_frequency=2, special_tokens=["<|endoftext|>"])
    bpe.save_model(str(root))
    return str(root / "vocab.json"), str(root / "merges.txt")


def openai_gpt2_bpe(vocab, merges):
    """GPT-2's original encoder (OpenAI's encoder.py, which Megatron-LM's gpt2_tokenization
    copies): the byte-to-unicode map, the pre-tokenizing regex, the merge loop."""
    import regex

    table = json.load(open(vocab, encoding="utf-8"))
    lines = open(merges, encoding="utf-8").read().split("\n")[1:]
    ranks = {tuple(line.split()): i for i, line in enumerate(lines) if line.strip()}
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_map = dict(zip(bs, map(chr, cs)))
    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def bpe(word):
        word = tuple(word)
        while len(word) > 1:
            pairs = {(a, b) for a, b in zip(word, word[1:])}
            best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode(text):
        ids = []
        for token in pattern.findall(text):
            ids += [table[piece]
                    for piece in bpe("".join(byte_map[b] for b in token.encode("utf-8")))]
        return ids
    return encode


def test_gpt2_bpe_gives_the_ids_of_gpt2s_encoder_and_transformers(gpt2_files):
    import os

    from transformers import GPT2TokenizerFast

    vocab, merges = gpt2_files
    ours = GPT2BPETokenizer(vocab, merges)
    fast = GPT2TokenizerFast.from_pretrained(os.path.dirname(vocab))  # the same two files
    original = openai_gpt2_bpe(vocab, merges)
    for text in TEXTS:
        assert ours.encode(text) == fast(text)["input_ids"] == original(text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]
    ids, lengths = ours.encode_packed(TEXTS)
    assert lengths.tolist() == [len(ours.encode(t)) for t in TEXTS]
    assert ours.vocab_size == len(json.load(open(vocab)))
    assert ours.eod == json.load(open(vocab))["<|endoftext|>"] == fast.eos_token_id
    # Megatron-LM's GPT-2 tokenizer has no special tokens: the text is encoded as characters
    assert ours.eod not in ours.encode("a<|endoftext|>b")
    assert ours.encode("a<|endoftext|>b") == original("a<|endoftext|>b")
    json.dumps(ours.unique_identifiers)


def test_gpt2_bpe_from_a_directory_and_its_errors(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    import os

    assert build_megatron_tokenizer("GPT2BPETokenizer", os.path.dirname(vocab)).vocab_size == len(
        json.load(open(vocab)))
    with pytest.raises(ValueError, match="GPT2BPETokenizer needs --vocab-file"):
        build_megatron_tokenizer("GPT2BPETokenizer")
    with pytest.raises(FileNotFoundError, match="--merge-file"):
        build_megatron_tokenizer("GPT2BPETokenizer", vocab_file=vocab,
                                 merge_file=str(tmp_path / "x"))
    (tmp_path / "v.json").write_text(json.dumps({"a": 0, "b": 1}))
    (tmp_path / "m.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="no <|endoftext|> token"):
        GPT2BPETokenizer(str(tmp_path / "v.json"), str(tmp_path / "m.txt"))


def test_null_tokenizer_is_megatron_lms():
    tok = NullTokenizer(300)
    assert (tok.vocab_size, tok.eod) == (301, 300)
    assert tok.encode("12 7 300") == [12, 7, 300] and tok.decode([12, 7]) == "12 7"
    with pytest.raises(ValueError, match="not integers separated by single spaces"):
        tok.encode("12  7")
    with pytest.raises(ValueError, match="outside 0..300"):
        tok.encode("301")
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_megatron_tokenizer("NullTokenizer")


@pytest.fixture(scope="module")
def llama2_model(tmp_path_factory):
    import sentencepiece

    root = tmp_path_factory.mktemp("sp")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 30))
    models = {}
    for name, bos in (("llama2", 1), ("no_bos", -1)):
        sentencepiece.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(root / name), vocab_size=48, unk_id=0, bos_id=bos,
            eos_id=2, pad_id=-1, minloglevel=2)
        models[name] = str(root / f"{name}.model")
    return models


def test_llama2_tokenizer_gives_sentencepiece_ids_and_bos_first_with_legacy(llama2_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=llama2_model["llama2"])
    tok = Llama2Tokenizer(llama2_model["llama2"])
    legacy = Llama2Tokenizer(llama2_model["llama2"], legacy=True)
    for text in TEXTS:
        assert tok.encode(text) == sp.encode(text)  # Megatron-LM's default tokenizer system
        assert legacy.encode(text) == [sp.bos_id()] + sp.encode(text)  # its legacy tokenize
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert legacy.encode_batch(TEXTS) == [legacy.encode(t) for t in TEXTS]
    assert (tok.vocab_size, tok.eod, tok.bos) == (sp.vocab_size(), sp.eos_id(), sp.bos_id())
    assert not hasattr(tok, "pad")  # megatron-core then pads with an id no text has
    assert tok.decode(tok.encode("hello world")) == "hello world"
    with pytest.raises(ValueError, match="no BOS or no EOS piece"):
        Llama2Tokenizer(llama2_model["no_bos"])
    with pytest.raises(ValueError, match="Llama2Tokenizer needs --tokenizer-model"):
        build_megatron_tokenizer("Llama2Tokenizer")


def test_trainer_takes_megatron_lm_tokenizer_flags(demo_data, gpt2_files):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file (the demo's byte ids are
    below the 400-entry vocabulary)."""
    vocab, merges = gpt2_files
    proc = train(base_args(demo_data, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab,
                           merge_file=merges, train_iters=1))
    assert "done: 1 steps" in proc.stdout
    proc = train(base_args(demo_data, tokenizer_type="GPT2BPETokenizer", train_iters=1),
                 check=False)
    assert proc.returncode == 2 and "GPT2BPETokenizer needs --vocab-file" in proc.stderr
