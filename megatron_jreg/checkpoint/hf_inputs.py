"""What a Hugging Face model brings to ``from_hf``, checked before a weight is read or
anything is written: the config (a GGUF file's family from its header alone, then its
metadata) with the values the import reads, and, once loaded, the weights' finiteness.
Each problem is one InputError naming the file, the field or tensor, and the value.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional

import torch

from megatron_jreg.checkpoint.hf_families import FAMILY_NAMES as FAMILIES
from megatron_jreg.errors import InputError
from megatron_jreg.hf_models import brief, gguf_architecture
from megatron_jreg.hf_models.claims import count_problem, read_config_json

# config.json fields the import reads, by what they must hold. transformers takes some
# wrong values silently (rope_theta "abc") and fails on others deep inside its code
_COUNTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "intermediate_size", "vocab_size", "max_position_embeddings", "head_dim",
           "num_local_experts", "num_experts_per_tok", "n_layer", "n_embd", "n_head", "n_inner",
           "n_positions")
_OPTIONAL = ("num_key_value_heads", "head_dim", "n_inner")  # null: the family's default
_POSITIVE = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon")
_NON_NEGATIVE = ("initializer_range", "router_aux_loss_coef")
_SWITCHES = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window",
             "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn")


def _wrong(value, field: str) -> Optional[str]:
    """What ``value`` of config field ``field`` should have been, or None when it is right."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if value is None:
        return None if field in _OPTIONAL else "a value, not null"
    if field in _COUNTS:
        return count_problem(value)
    if field in _POSITIVE + _NON_NEGATIVE:
        zero_ok = field in _NON_NEGATIVE
        if number and math.isfinite(value) and (value >= 0 if zero_ok else value > 0):
            return None
        return "a finite number >= 0" if zero_ok else "a finite number > 0"
    return None if isinstance(value, bool) else "true or false"


def check_config_values(config: Dict[str, object], source: str) -> None:
    """The fields the import reads hold values of their kind (integers >= 1 for sizes,
    finite positive numbers, true/false); else one InputError naming the field, the value
    and ``source`` (the config.json or GGUF file). Other model types are refused by
    ``from_hf.model_values``, by name, before their fields matter."""
    if config.get("model_type") not in FAMILIES:
        return
    fields = [(field, field, config[field]) for field in
              _COUNTS + _POSITIVE + _NON_NEGATIVE + _SWITCHES if field in config]
    for nest in ("rope_parameters", "rope_scaling"):  # transformers 5's place for the base
        if isinstance(config.get(nest), dict) and "rope_theta" in config[nest]:
            fields.append((f"{nest}.rope_theta", "rope_theta", config[nest]["rope_theta"]))
    for name, field, value in fields:
        expected = _wrong(value, field)
        if expected:
            shown = "null" if value is None else repr(value)
            raise InputError(f"{source}: {name} is {shown}, not {expected}; correct it in "
                             "that file")


def config_before_weights(path: str, hf_model: str):
    """The transformers config of ``path`` read without any weight, its values checked:
    a directory's config.json, or a GGUF file's metadata, whose ``general.architecture``
    is checked first (transformers dequantizes every tensor, minutes to hours, before a
    GGUF model exists to be refused)."""
    import transformers

    if os.path.isdir(path):
        check_config_values(read_config_json(path, f"--hf-model {hf_model}"),
                            os.path.join(path, "config.json"))
        try:
            return transformers.AutoConfig.from_pretrained(path)
        except Exception as err:
            raise InputError(
                f"--hf-model {hf_model}: cannot read config.json ({brief(err)})") from None
    architecture = gguf_architecture(path)
    if architecture not in FAMILIES:
        raise InputError(
            f"--hf-model {hf_model}: a GGUF file of architecture {architecture!r} "
            "(general.architecture), not one of the families here (Llama, Qwen3, Mixtral, "
            "GPT-2; docs/families.md): it cannot be converted")
    directory, name = os.path.split(os.path.abspath(path))
    try:
        config = transformers.AutoConfig.from_pretrained(directory, gguf_file=name)
    except Exception as err:
        raise InputError(f"--hf-model {hf_model}: transformers cannot read this GGUF file's "
                         f"metadata ({brief(err)}); check the file") from None
    check_config_values(config.to_dict(), path)
    return config


def check_finite_weights(state: Dict[str, torch.Tensor], hf_model: str) -> None:
    """Every weight finite; else one InputError naming the source and the first tensors
    with NaN or infinite values, before anything is written."""
    bad = [(name, int((~torch.isfinite(t)).sum())) for name, t in state.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        name, count = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise InputError(f"--hf-model {hf_model}: the model's weights are not finite: {name} "
                         f"holds {count} NaN or infinite values{more}; the files are damaged "
                         "or come from a diverged run, so it is not converted")
