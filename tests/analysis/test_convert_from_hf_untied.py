"""convert_from_hf keeps a distinct output layer distinct, in every family.

For Llama, Qwen3, Mixtral and GPT-2: a tiny random model saved with its own
``lm_head.weight`` (``tie_word_embeddings: false``), and the same files under a config.json
that says ``tie_word_embeddings: true`` (transformers then loads the distinct lm_head and
warns), are imported; our model's logits equal those of
``AutoModelForCausalLM.from_pretrained`` of the same directory to fp32 tolerance (the old
import tied the output layer to the embedding: logits off by 1.2 to 1.4 of their largest
value in these models), and
``convert_to_hf`` writes the lm_head back bit for bit, distinct from the embedding, under
``tie_word_embeddings: false``. A mapping asked to tie an lm_head that differs from the
embedding refuses instead of dropping it.
"""

import json
import os

import pytest
import torch
from test_convert_from_hf import _hf_logits, _our_logits, _relative, _run, _tiny_models

FAMILIES = ["llama", "qwen3", "mixtral", "gpt2"]
EMBEDDING = {"gpt2": "transformer.wte.weight"}


def _save_untied(family, directory, config_says_tied):
    import transformers
    from tiny_tokenizer import save_tokenizer

    config = _tiny_models()[family]
    config.tie_word_embeddings = False
    torch.manual_seed(11)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(str(directory))
    if config_says_tied:
        path = os.path.join(directory, "config.json")
        saved = json.load(open(path))
        saved["tie_word_embeddings"] = True
        json.dump(saved, open(path, "w"))
    return str(directory)


@pytest.mark.parametrize("config_says_tied", [False, True], ids=["untied", "config_tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_distinct_lm_head_stays_distinct(family, config_says_tied, tmp_path):
    from safetensors.torch import load_file

    hf_dir = _save_untied(family, tmp_path / "hf", config_says_tied)
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    embedding = EMBEDDING.get(family, "model.embed_tokens.weight")
    assert not torch.equal(original["lm_head.weight"], original[embedding])
    ckpt = tmp_path / "ckpt"
    proc = _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", ckpt])

    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 12))
    reference = _hf_logits(hf_dir, ids)
    ours = _our_logits(str(ckpt), ids, tmp_path)
    error = _relative(ours, reference)
    print(f"{family} ({'config tied' if config_says_tied else 'untied'}): logits max "
          f"relative difference {error:.2e}, absolute "
          f"{(ours[..., :96] - reference).abs().max().item():.2e}")
    assert error <= 1e-5
    assert ("imported untied" in proc.stdout) == config_says_tied, proc.stdout
    run_config = (ckpt / "iter_0000000" / "run_config.yaml").read_text()
    assert "untie_embeddings_and_output_weights: true" in run_config

    back = tmp_path / "back"
    _run(["tools/convert_to_hf.py", "--load", ckpt, "--output", back])
    exported = load_file(str(back / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    assert json.load(open(back / "config.json"))["tie_word_embeddings"] is False
    assert torch.equal(_hf_logits(str(back), ids), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_tying_a_distinct_lm_head_is_refused(family):
    """The mapping itself never drops a distinct lm_head for a tied model."""
    import transformers

    from megatron_jreg.checkpoint.from_hf import model_values
    from megatron_jreg.checkpoint.hf_families import megatron_state_dict
    from megatron_jreg.config.model import ModelConfig
    from megatron_jreg.errors import InputError

    config = _tiny_models()[family]
    config.tie_word_embeddings = False
    state = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    cfg = ModelConfig(**{**model_values(config), "untie_embeddings_and_output_weights": False})
    assert cfg.family == family
    with pytest.raises(InputError, match="lm_head.weight differs from the embedding"):
        megatron_state_dict(state, cfg)
    state["lm_head.weight"] = state[EMBEDDING.get(family, "model.embed_tokens.weight")]
    assert "output_layer.weight" not in megatron_state_dict(state, cfg)  # tied: one tensor
