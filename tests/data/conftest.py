"""Shared fixtures: tiny tokenizers and corpora built in the test, no downloads."""

import warnings

import pytest
from preprocess_helpers import SENTENCES, make_documents, write_jsonl

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory):
    from megatron_jreg.data.tokenizers.training import TrainTokenizerConfig, train_sentencepiece

    d = tmp_path_factory.mktemp("sp")
    corpus = write_jsonl(d / "train.jsonl", [{"text": t} for t in make_documents(300)])
    return train_sentencepiece(
        TrainTokenizerConfig(input=[corpus], model_prefix=str(d / "tok"), vocab_size=400)
    )


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 20, trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture
def tokenizer_args(request, sp_model, hf_tokenizer_json):
    """(flags, build_tokenizer kwargs) for the tokenizer kind named by the parametrisation."""
    kind = getattr(request, "param", "ByteTokenizer")
    model = {"SentencePieceTokenizer": sp_model,
             "HuggingFaceTokenizer": hf_tokenizer_json}.get(kind)
    flags = ["--tokenizer-type", kind] + (["--tokenizer-model", model] if model else [])
    return flags, {"tokenizer_type": kind, "tokenizer_model": model}
