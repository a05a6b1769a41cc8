"""The one tokenizer interface: each kind's contract, and errors that name the fix."""

import json

import numpy
import pytest
from preprocess_helpers import SENTENCES

from megatron_jreg.data.preprocess.workers import token_dtype
from megatron_jreg.data.tokenizers.build import build_tokenizer

KINDS = ["ByteTokenizer", "SentencePieceTokenizer", "HuggingFaceTokenizer"]


@pytest.mark.parametrize("tokenizer_args", KINDS, indirect=True)
def test_interface(tokenizer_args):
    _, kwargs = tokenizer_args
    tok = build_tokenizer(**kwargs)
    assert isinstance(tok.vocab_size, int) and 0 <= tok.eod < tok.vocab_size
    json.dumps(tok.unique_identifiers)  # GPTDataset hashes it into its cache key
    for text in SENTENCES:
        ids = tok.encode(text)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.eod not in ids  # encode adds no specials; EOD is preprocessing's job
        assert tok.decode(ids) == text
    assert tok.encode_batch(SENTENCES) == [tok.encode(t) for t in SENTENCES]


@pytest.mark.parametrize("tokenizer_args", KINDS, indirect=True)
def test_encode_packed_is_encode_batch_as_arrays(tokenizer_args):
    tok = build_tokenizer(**tokenizer_args[1])
    texts = SENTENCES + ["", " "]
    paths = [True, False] if hasattr(tok, "_numpy_out") else [None]
    for numpy_out in paths:  # sentencepiece: its numpy output, and lists where it has none
        if numpy_out is not None:
            tok._numpy_out = numpy_out
        ids, lengths = tok.encode_packed(texts)
        assert lengths.dtype == numpy.int32
        assert lengths.tolist() == [len(tok.encode(t)) for t in texts]
        assert ids.tolist() == [i for t in texts for i in tok.encode(t)]
        assert tok.encode_packed([])[0].size == 0


def test_byte_tokenizer_padding_and_ids():
    tok = build_tokenizer("ByteTokenizer", vocab_size=512)
    assert tok.vocab_size == 512 and tok.eod == 256
    assert tok.encode("é") == [0xC3, 0xA9]
    with pytest.raises(ValueError, match="at least 259"):
        build_tokenizer("ByteTokenizer", vocab_size=100)


def test_hf_eos_from_tokenizer_config(tmp_path, hf_tokenizer_json):
    (tmp_path / "tokenizer.json").write_bytes(open(hf_tokenizer_json, "rb").read())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = build_tokenizer("HuggingFaceTokenizer", str(tmp_path))  # a directory works too
    assert tok.eod == build_tokenizer("HuggingFaceTokenizer", hf_tokenizer_json).eod
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


@pytest.mark.parametrize(
    "args, error, match",
    [
        (("Nope",), ValueError, "not supported"),
        (("SentencePieceTokenizer",), ValueError, "needs --tokenizer-model"),
        (("SentencePieceTokenizer", "/no/such.model"), FileNotFoundError, "not a file"),
        (("HuggingFaceTokenizer", "/no/such/dir"), FileNotFoundError, "no tokenizer.json"),
        (("ByteTokenizer", "x.model"), ValueError, "drop --tokenizer-model"),
    ],
)
def test_build_errors(args, error, match):
    with pytest.raises(error, match=match):
        build_tokenizer(*args)


def test_unreadable_model_file(tmp_path, sp_model):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot load"):
        build_tokenizer("SentencePieceTokenizer", str(bad))
    with pytest.raises(ValueError, match="drop --vocab-size"):
        build_tokenizer("SentencePieceTokenizer", sp_model, vocab_size=1000)


@pytest.mark.parametrize("vocab_size", [256, 32000, 65499, 65500, 65536, 128256])
def test_token_dtype_matches_megatron(vocab_size):
    from megatron.core.datasets.indexed_dataset import DType

    assert token_dtype(vocab_size) is DType.optimal_dtype(vocab_size)
    assert numpy.iinfo(token_dtype(vocab_size)).max >= vocab_size - 1
