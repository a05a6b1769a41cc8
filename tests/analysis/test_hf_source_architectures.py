"""HFCausalLMSource finds the decoder layers and final norm of the common layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_jreg.analysis import InputError, JumpAccumulator, pad_batch
from megatron_jreg.analysis.hf_source import HFCausalLMSource, find_decoder_layers

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=100
)
CONFIGS = {
    "qwen2": lambda: transformers.Qwen2Config(num_key_value_heads=2, **SMALL),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, **SMALL),
    "gemma": lambda: transformers.GemmaConfig(num_key_value_heads=2, head_dim=8, **SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SMALL),
    "opt": lambda: transformers.OPTConfig(
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        vocab_size=100,
        word_embed_proj_dim=32,
    ),
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=32, n_layer=3, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0
    ),
}
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=0)  # accumulate() needs no real tokenizer


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_matches_output_hidden_states(arch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval()
    source = HFCausalLMSource(model, TOKENIZER, arch, include_final_norm=True)
    ids, mask = pad_batch([[5, 6, 7, 8, 9, 10]], pad_id=0)
    measured = JumpAccumulator(3)
    source.accumulate(ids, mask, measured)
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states  # h_0..h_{L-1}, norm(h_L)
    expected = JumpAccumulator(3)
    expected.add_states(states)
    assert measured.displacement() == pytest.approx(expected.displacement(), abs=1e-6)


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(InputError, match="_LAYOUTS"):
        find_decoder_layers(torch.nn.Linear(2, 2))
