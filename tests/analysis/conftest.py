"""A tiny random Llama with a word-level tokenizer, built here (no downloads)."""

from __future__ import annotations

import random

import pytest
import torch

VOCAB_WORDS = [f"w{i}" for i in range(90)]
SPECIAL = ["[UNK]", "[PAD]", "<s>", "</s>"]


def _documents(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCAB_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(n)]


def _save_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + VOCAB_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # The tokenizer adds <s> itself, so "special tokens as the tokenizer adds them" matters.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory) -> str:
    """Directory of a 3-layer LlamaForCausalLM (hidden 32, 4 heads, vocab 96) + tokenizer."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=len(SPECIAL) + len(VOCAB_WORDS),
        max_position_embeddings=128,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger than HF's std-0.02 init so layers rotate the states visibly; norm weights
        # away from 1 so the final norm changes the direction of h_L (a uniform scale
        # would leave every cosine as it is); a strong last MLP so the model has a jump.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.2, 2.0)
        model.model.layers[-1].mlp.down_proj.weight.mul_(10.0)
    model.save_pretrained(path)
    _save_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def eval_text(tmp_path_factory) -> str:
    """Eleven documents of 3..20 words, with blank lines that must be skipped."""
    path = str(tmp_path_factory.mktemp("text") / "eval.txt")
    docs = _documents(11)
    with open(path, "w") as f:
        f.write("\n".join(docs[:5]) + "\n\n   \n" + "\n".join(docs[5:]) + "\n")
    return path


@pytest.fixture(scope="session")
def eval_documents() -> list:
    return _documents(11)
