"""A --seq-length beyond a model's learned positions is one line naming the limit, not an
IndexError traceback from the position embedding."""

import os

import pytest
import torch
from tiny_tokenizer import SPECIAL, VOCAB_WORDS, save_tokenizer

import forked_trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_gpt2_seq_length_beyond_its_positions(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    path = str(tmp_path / "gpt2")
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=16,
                        vocab_size=len(SPECIAL) + len(VOCAB_WORDS), bos_token_id=2,
                        eos_token_id=3)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    save_tokenizer(path)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(VOCAB_WORDS[:40]) + "\n" + " ".join(VOCAB_WORDS[40:80]) + "\n")
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_JREG_DEVICE="cpu")

    def eval_jump(seq):
        return forked_trainer.run_tool("tools/eval_jump.py", [
            "--hf-model", path, "--text-file", text, "--seq-length", seq, "--no-progress"],
            env, timeout=300)

    proc = eval_jump(32)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert "--seq-length 32: the model has learned positions for 16 tokens only" in err[0]
    assert eval_jump(16).returncode == 0
