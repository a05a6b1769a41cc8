"""Fixtures: a tiny random HF Llama (no downloads) and tiny checkpoints of our trainer."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_tokenizer import SPECIAL, VOCAB_WORDS
from tiny_tokenizer import save_tokenizer as _save_tokenizer

from session_cache import build_once


def _documents(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(VOCAB_WORDS) for _ in range(rng.randint(3, 20))) for _ in range(n)]


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


# ---- checkpoints of our trainer (tests of --load and convert_to_hf) ----------------------


@pytest.fixture(scope="session")
def trained_checkpoints(tmp_path_factory):
    """{"tp1", "tp2", "pp2"}: runs of one seed and data; tp1 saves every iteration."""
    from checkpoint_runs import make_dataset, train

    def build(root):
        data = make_dataset(str(root))
        return {
            "tp1": train(data, str(root / "tp1"), save_interval=1),
            "tp2": train(data, str(root / "tp2"), nproc=2, tensor_model_parallel_size=2),
            "pp2": train(data, str(root / "pp2"), nproc=2, pipeline_model_parallel_size=2),
        }

    return build_once(tmp_path_factory, "trained_checkpoints", build)


@pytest.fixture(scope="session")
def checkpoint_text(tmp_path_factory):
    """(text file, tokens [b, SEQ]): eight ASCII documents of exactly SEQ bytes."""
    from checkpoint_runs import SEQ

    rng = random.Random(7)
    words = ["jump", "layer", "norm", "token", "state", "model", "the", "of", "a", "residual"]
    docs = []
    for _ in range(8):
        text = ""
        while len(text) < SEQ:
            text += rng.choice(words) + " "
        docs.append(text[:SEQ])
    root = tmp_path_factory.mktemp("ckpt_text")
    path = root / "eval.txt"
    path.write_text("\n".join(docs) + "\n")
    tokens = torch.tensor([list(d.encode("ascii")) for d in docs], dtype=torch.long)
    tokens_file = root / "tokens.pt"
    torch.save(tokens, tokens_file)
    return str(path), str(tokens_file)


@pytest.fixture(scope="session")
def checkpoint_reference(trained_checkpoints, checkpoint_text, tmp_path_factory):
    """The trainer's Psi_l and logits (checkpoint_worker.py) for the tp1 and tp2 runs."""
    from checkpoint_runs import reference

    roots = [trained_checkpoints["tp1"], trained_checkpoints["tp2"]]

    def build(root):
        reference(checkpoint_text[1], root / "ref.pt", roots)
        return str(root / "ref.pt")

    return torch.load(build_once(tmp_path_factory, "checkpoint_reference", build))
