"""HFCausalLMSource finds the decoder layers and final norm of the common layouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_jreg.analysis.batching import pad_batch
from megatron_jreg.analysis.hf_source import HFCausalLMSource, find_decoder_layers
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.errors import InputError

transformers = pytest.importorskip("transformers")

SMALL = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=100
)


def _gemma3_text():
    # sliding_window < the 6 test tokens, so the sliding layers' masks matter
    return transformers.Gemma3TextConfig(
        num_key_value_heads=2, head_dim=8, sliding_window=4, **SMALL
    )


def _gemma3_multimodal():
    # Gemma3ForConditionalGeneration: the decoder sits at model.language_model (text-only run)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    return transformers.Gemma3Config(
        text_config=_gemma3_text().to_dict(), vision_config=vision, mm_tokens_per_image=4
    )


# arch: (config, the decoder layers and final norm, as paths written out here: the test
# does not ask hf_source where they are)
CONFIGS = {
    "qwen2": (lambda: transformers.Qwen2Config(num_key_value_heads=2, **SMALL),
              "model.layers", "model.norm"),
    "mistral": (lambda: transformers.MistralConfig(num_key_value_heads=2, **SMALL),
                "model.layers", "model.norm"),
    "gemma": (lambda: transformers.GemmaConfig(num_key_value_heads=2, head_dim=8, **SMALL),
              "model.layers", "model.norm"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(**SMALL),
                 "gpt_neox.layers", "gpt_neox.final_layer_norm"),
    "opt": (
        lambda: transformers.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            vocab_size=100,
            word_embed_proj_dim=32,
        ),
        "model.decoder.layers", "model.decoder.final_layer_norm",
    ),
    "gpt2": (
        lambda: transformers.GPT2Config(
            n_embd=32, n_layer=3, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0
        ),
        "transformer.h", "transformer.ln_f",
    ),
}
if hasattr(transformers, "Gemma3TextConfig") and hasattr(transformers, "Gemma3ForCausalLM"):
    CONFIGS["gemma3_text"] = (_gemma3_text, "model.layers", "model.norm")
    if hasattr(transformers, "Gemma3ForConditionalGeneration"):
        CONFIGS["gemma3"] = (
            _gemma3_multimodal, "model.language_model.layers", "model.language_model.norm"
        )
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=0)  # accumulate() needs no real tokenizer
IDS = [5, 6, 7, 8, 9, 10]


def _attr(obj, path):
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def _psi(states):
    """Psi_l = mean over tokens of (1 - cos(h_{l-1}, h_l)) / 2, in float64, one sequence."""
    out = []
    for prev, cur in zip(states[:-1], states[1:]):
        a, b = prev[0].double(), cur[0].double()
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        out.append(float(((1 - cos) / 2).mean()))
    return out


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def arch_model(request):
    """(arch, model, Psi before the final norm, Psi with it) computed from HF's own outputs.

    HF's hidden_states are h_0..h_{L-1} and then final_norm(h_L); h_L itself comes from a
    hook on the last decoder layer.
    """
    make_config, layers_path, norm_path = CONFIGS[request.param]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config()).eval()
    layers, norm = _attr(model, layers_path), _attr(model, norm_path)
    with torch.no_grad():  # a non-uniform final norm turns h_L (an RMSNorm of ones only scales)
        for p in norm.parameters():
            p.uniform_(0.2, 2.0)
    last = []
    handle = layers[-1].register_forward_hook(
        lambda mod, args, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    with torch.no_grad():
        states = list(model(torch.tensor([IDS]), output_hidden_states=True).hidden_states)
        handle.remove()
        assert len(states) == len(layers) + 1 == 4 and len(last) == 1
        # what the reference relies on: HF's last hidden state is the final norm of h_L
        torch.testing.assert_close(states[-1], norm(last[0]), rtol=1e-5, atol=1e-6)
    with_norm = _psi(states)
    before_norm = _psi(states[:-1] + [last[0]])
    assert with_norm[:-1] == before_norm[:-1]
    assert abs(with_norm[-1] - before_norm[-1]) > 1e-4  # so the two modes can be told apart
    return request.param, model, before_norm, with_norm


@pytest.mark.parametrize("include_final_norm", [False, True], ids=["before_norm", "final_norm"])
def test_matches_output_hidden_states(arch_model, include_final_norm):
    arch, model, before_norm, with_norm = arch_model
    source = HFCausalLMSource(model, TOKENIZER, arch, include_final_norm=include_final_norm)
    ids, mask = pad_batch([IDS], pad_id=0)
    measured = JumpAccumulator(3)
    source.accumulate(ids, mask, measured)
    expected = with_norm if include_final_norm else before_norm
    assert measured.displacement() == pytest.approx(expected, abs=1e-6, rel=0)


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(InputError, match="_LAYOUTS"):
        find_decoder_layers(torch.nn.Linear(2, 2))
