"""``--use-checkpoint-args``: the architecture from the checkpoint a run starts from.

As in Megatron-LM, the checkpoint's architecture fields (``--load``'s checkpoint, else
``--pretrained-checkpoint``'s) replace the model flags; a flag given for one of them must agree,
else the run stops naming it. ``--seq-length`` and the fields that leave the weights alone
(dropout, precision, attention implementation, MoE dispatch) stay the run's own. Without a
tokenizer flag the tokenizer is the checkpoint's too.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Dict, List, Optional

from megatron_jreg.checkpoint.faults import NoDirectory, Wording
from megatron_jreg.config.model import ModelConfig
from megatron_jreg.config.run import CheckpointConfig
from megatron_jreg.config.schema import flag_of
from megatron_jreg.errors import ConfigError
from megatron_jreg.training import source as starting

# the ModelConfig fields a checkpoint's weights do not pin
RUN_FIELDS = ("model_preset", "seq_length", "padded_vocab", "hidden_dropout",
              "attention_dropout", "attention_backend", "attention_softmax_in_fp32", "bf16",
              "fp16", "transformer_impl", "moe_token_dispatcher_type", "moe_grouped_gemm",
              "moe_aux_loss_coeff", "moe_router_load_balancing_type", "init_method_std",
              "make_vocab_size_divisible_by")
ARCHITECTURE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                            if f.name not in RUN_FIELDS)
_FIELDS = ModelConfig.__dataclass_fields__
TOKENIZER_FIELDS = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file",
                    "legacy_tokenizer")


# architecture fields compared through what they resolve to (a preset and its explicit
# flags, an unset --ffn-hidden-size and its computed size compare equal)
_RESOLVED = {"num_query_groups": "query_groups", "ffn_hidden_size": "ffn_size",
             "moe_ffn_hidden_size": "moe_ffn_size", "kv_channels": "head_dim",
             "group_query_attention": None, "vocab_size": None}


def _resolved(cfg: ModelConfig, name: str):
    if name == "max_position_embeddings":  # only learned positions have weights per position
        return cfg.max_positions if cfg.position_embedding_type == "learned_absolute" else None
    if name == "moe_ffn_hidden_size" and not cfg.num_experts:
        return None
    return getattr(cfg, _RESOLVED.get(name) or name)


def architecture_differences(saved: ModelConfig, mine: ModelConfig) -> List[str]:
    """``--flag SAVED (this run: MINE)`` for each architecture field that differs (the
    vocabulary is the tokenizer's, compared with it)."""
    return [f"{flag_of(_FIELDS[name])} {_resolved(saved, name)} (this run: {_resolved(mine, name)})"
            for name in ARCHITECTURE_FIELDS
            if (name not in _RESOLVED or _RESOLVED[name])
            and _resolved(saved, name) != _resolved(mine, name)]


def missing_directory(flag: str, path: str) -> str:
    """The error for a checkpoint flag whose directory is not there (the catalog's words)."""
    return NoDirectory(root=path, is_file=os.path.exists(path)).phrase(Wording(root=flag))


def checkpoint_configs(checkpoint: Dict[str, object]) -> starting.StartingPoint:
    """The checkpoint the run starts from (``checkpoint``: the section as given), read."""
    defaults = {f.name: f.default for f in dataclasses.fields(CheckpointConfig)
                if f.default is not dataclasses.MISSING}
    c = types.SimpleNamespace(**{**defaults, **checkpoint})
    choice = starting.choose(c)
    if choice is None:
        raise ConfigError("--use-checkpoint-args reads the architecture from a checkpoint: pass "
                          "--load (holding one) or --pretrained-checkpoint")
    return starting.read(choice, verify=not c.no_verify_checkpoint)


def apply_checkpoint_args(values: Dict[str, Dict[str, object]],
                          read: Optional[dict] = None) -> None:
    """``commands.flags.parse``'s ``resolve`` hook: rewrite the model (and tokenizer)
    settings. The checkpoint read goes to ``read["start"]``: the run plan reads it no more."""
    if not values["checkpoint"].get("use_checkpoint_args"):
        return
    start = checkpoint_configs(values["checkpoint"])
    if read is not None:
        read["start"] = start
    flag, root, saved = start.flag, start.root, start.source.format.configs
    model, given = saved["model"], values["model"]
    where = f"(--use-checkpoint-args takes the architecture from {flag} {root})"
    if given.get("model_preset"):
        raise ConfigError(f"--model-preset {given['model_preset']} conflicts with "
                          f"--use-checkpoint-args {where}; drop it")

    def resolved(name: str, value):  # --kv-channels unset means hidden / heads
        return model.head_dim if name == "kv_channels" and value is None else value

    data = values["data"]
    tokenizer_type = data.get("tokenizer_type") or saved["data"].tokenizer_type
    null_vocab = tokenizer_type == "NullTokenizer" and model.vocab_size
    # NullTokenizer's --vocab-size counts the ids before its EOD; the saved vocabulary
    # counts it (as the trainer resolves it)
    flag_values = {"vocab_size": model.vocab_size - 1} if null_vocab else {}

    def saved_value(name: str):
        return flag_values.get(name, resolved(name, getattr(model, name)))

    for name in ARCHITECTURE_FIELDS:
        if name in given and resolved(name, given[name]) != saved_value(name):
            raise ConfigError(f"{flag_of(_FIELDS[name])} {given[name]} differs from the "
                              f"checkpoint's {saved_value(name)} {where}; "
                              f"drop {flag_of(_FIELDS[name])}")
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.default is not dataclasses.MISSING}
    merged = {**{k: defaults[k] for k in RUN_FIELDS if k in defaults},
              **{k: flag_values.get(k, getattr(model, k)) for k in ARCHITECTURE_FIELDS},
              "seq_length": model.seq_length, "padded_vocab": None, "model_preset": None}
    merged.update({k: v for k, v in given.items() if k in RUN_FIELDS})
    if merged["max_position_embeddings"] is not None and \
            merged["seq_length"] > merged["max_position_embeddings"]:
        raise ConfigError(f"--seq-length {merged['seq_length']} exceeds the checkpoint's "
                         f"--max-position-embeddings {merged['max_position_embeddings']} {where}")
    values["model"] = merged
    if not any(name in data for name in TOKENIZER_FIELDS):
        for name in TOKENIZER_FIELDS:
            value = getattr(saved["data"], name)
            if value is not None:
                data[name] = value
