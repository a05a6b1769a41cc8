"""Megatron-LM's ``args`` in a checkpoint's common state, both ways.

:func:`megatron_lm_args` writes a resolved run as Megatron-LM's argument namespace (a
``types.SimpleNamespace`` of its argparse destinations), so Megatron-LM resumes and converts
what we save; :func:`sections_from_args` reads one back into this project's config sections,
for a checkpoint without ``run_config.yaml``. Imports neither megatron-core nor the model.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
import types
import typing
from typing import Dict, Optional

import torch

from megatron_jreg.config.megatron_lm import REFUSED, TABLE
from megatron_jreg.config.model import TRANSFORMER_IMPLS, ModelConfig, ParallelConfig
from megatron_jreg.config.run import SECTIONS
from megatron_jreg.config.tokenizer_names import TOKENIZER_TYPES
from megatron_jreg.errors import ConfigError, InputError

CHECKPOINT_VERSION = 3.0  # Megatron-LM's common-state version of torch_dist checkpoints
COMMON_FILE = "common.pt"  # megatron-core's common (unsharded) state of an iteration

# Megatron-LM fields with no setting here, and the values this project's models have
_FIXED = {
    "use_mcore_models": True, "use_legacy_models": False, "spec": None,
    "squared_relu": False, "openai_gelu": False, "apply_query_key_layer_scaling": False,
    "hybrid_override_pattern": None, "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0,
    "is_hybrid_model": False, "heterogeneous_layers_config_path": None,
    "heterogeneous_layers_config_encoded_json": None, "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None, "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False, "moe_router_topk_scaling_factor": None,
    "moe_latent_size": None, "mamba_state_dim": 128, "mamba_head_dim": 64,
    "mamba_num_groups": 8, "mamba_num_heads": None, "tiktoken_pattern": None,
    "ckpt_format": "torch_dist", "use_dist_ckpt": True, "auto_detect_ckpt_format": False,
    "no_save_optim": False, "no_save_rng": False, "data_parallel_random_init": False,
    "skipped_train_samples": 0, "consumed_valid_samples": 0, "phase_transition_iterations": None,
}

# the architecture (and run) fields of ModelConfig read back from a Megatron-LM args
_MODEL_READ = tuple(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name not in ("model_preset", "padded_vocab", "vocab_size",
                                      "attention_backend", "transformer_impl",
                                      "make_vocab_size_divisible_by", "init_method_std"))
_PARALLEL_READ = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                  "virtual_pipeline_model_parallel_size", "context_parallel_size",
                  "expert_model_parallel_size", "sequence_parallel")
_TOKENIZER_READ = ("tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
_PLAIN = (type(None), bool, int, float, str)
# Megatron-LM's fields that take several values (nargs='+'): a list of the field's kind
_LISTED = ("moe_aux_loss_coeff", "moe_router_load_balancing_type")
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind(cls, name: str):
    """bool, int, float or str: the kind of field ``name`` of ``cls``, without Optional."""
    hint = typing.get_type_hints(cls)[name]
    kinds = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return kinds[0] if kinds[0] in _KIND_WORDS else None


_KINDS = {**{n: _kind(ModelConfig, n) for n in _MODEL_READ},
          **{n: _kind(ParallelConfig, n) for n in _PARALLEL_READ},
          "padded_vocab_size": int, "vocab_size": int, "make_vocab_size_divisible_by": int,
          "seed": int, "consumed_train_samples": int}

# a value as a message shows it: bounded however the pickle nested or repeated it
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 60, 60
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 4


def _is(value, kind) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def checked_arg(args, name: str, where: str, kind=None):
    """Field ``name`` of Megatron-LM's ``args`` (None when absent or None), checked to be a
    ``kind`` (the config field's, by default): a checkpoint's claim is not believed before it
    is typed. Raises InputError naming ``where``/common.pt, the field and its value."""
    value = getattr(args, name, None)
    kind = kind or _KINDS.get(name)
    if value is None or kind is None:
        return value
    items = value if name in _LISTED and isinstance(value, (list, tuple)) else [value]
    if not all(_is(item, kind) for item in items):
        raise InputError(f"{os.path.join(where, COMMON_FILE)}: args.{name} is "
                         f"{_SHOWN.repr(value)}, not {_KIND_WORDS[kind]}")
    return list(items) if items is value else value


def _plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, _PLAIN) for v in value)
    return isinstance(value, _PLAIN)


def megatron_lm_args(run, *, world_size: int, consumed_samples: int,
                     fully_reshardable: bool) -> types.SimpleNamespace:
    """Megatron-LM's ``args`` for resolved run ``run`` (an ExperimentConfig) as saved at a
    point where ``consumed_samples`` samples were trained on ``world_size`` processes."""
    values: Dict[str, object] = {}
    for name, section in run.sections().items():
        if name == "jreg":
            continue  # run_config.yaml carries it; Megatron-LM has no such fields
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if _plain(value):
                values[f.name] = list(value) if isinstance(value, tuple) else value
    m, p = run.model, run.parallel
    tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                  p.context_parallel_size)
    values.update(_FIXED)
    values.update(
        num_query_groups=m.query_groups, ffn_hidden_size=m.ffn_size, kv_channels=m.head_dim,
        max_position_embeddings=m.max_positions, add_bias_linear=m.add_bias_linear,
        # Megatron-LM's flag as the run gave it (--no-position-embedding; default True, also
        # with RoPE): its resume compares the value with its own command line
        add_position_embedding=not run.megatron_lm.no_position_embedding,
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        moe_ffn_hidden_size=m.moe_ffn_size if m.num_experts else None,
        # Megatron-LM pads to a multiple of this x TP: at this TP it gives our rows
        padded_vocab_size=m.padded_vocab_size(),
        make_vocab_size_divisible_by=max(1, m.make_vocab_size_divisible_by // tp),
        # Megatron-LM's NullTokenizer adds its EOD to --vocab-size; ours is counted in
        vocab_size=(m.vocab_size - 1 if run.data.tokenizer_type == "NullTokenizer"
                    and m.vocab_size else m.vocab_size),
        params_dtype=torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32,
        world_size=world_size, data_parallel_size=world_size // (tp * pp * cp),
        consumed_train_samples=int(consumed_samples),
        dist_ckpt_optim_fully_reshardable=fully_reshardable,
        transformer_impl=("transformer_engine" if m.transformer_impl == "transformer_engine"
                          else "local"),
    )
    return types.SimpleNamespace(**values)


def is_megatron_lm_state(common: Optional[dict]) -> bool:
    """A common state with Megatron-LM's fields (``args`` and ``checkpoint_version``)."""
    return bool(common) and "args" in common and "checkpoint_version" in common


# Megatron-LM's model fields that change what a layer computes from its weights, in a way
# this project does not build (the refused rows of config.megatron_lm's table say why)
_FORWARD_FIELDS = ("apply_layernorm_1p", "openai_gelu", "squared_relu", "quick_geglu",
                   "rotary_interleaved", "use_rope_scaling", "rotary_seq_len_interpolation_factor",
                   "apply_residual_connection_post_layernorm", "multi_latent_attention",
                   "is_hybrid_model")


def _refused(args) -> Optional[str]:
    """The first Megatron-LM model flag set in ``args`` that this project cannot build."""
    why = {row.flag[2:].replace("-", "_"): row.why for row in TABLE if row.status == REFUSED}
    for dest in _FORWARD_FIELDS:
        value = getattr(args, dest, None)
        if value not in (None, False):
            reason = why.get(dest)
            return f"--{dest.replace('_', '-')}" + (f" ({reason})" if reason else "")
    return None


def sections_from_args(args, where: str) -> Dict[str, object]:
    """This project's config sections (those of ``run_config.yaml``) for Megatron-LM's
    ``args``: the architecture, layout, tokenizer and seed it saved; the rest defaults.
    Raises InputError naming ``where`` when the model is one this project cannot build."""
    refused = _refused(args)
    if refused:
        raise InputError(f"{where}: the checkpoint's model uses {refused}, which this project "
                         "cannot build")

    def picked(names):
        values = {n: checked_arg(args, n, where) for n in names}
        return {n: v for n, v in values.items() if v is not None and _plain(v)}

    model = picked(_MODEL_READ)
    tp = checked_arg(args, "tensor_model_parallel_size", where) or 1
    padded = checked_arg(args, "padded_vocab_size", where)
    # the tokenizer's names as text (a path saved as another type is left out)
    tokenizer = {n: getattr(args, n) for n in _TOKENIZER_READ
                 if isinstance(getattr(args, n, None), str)}
    if tokenizer.get("tokenizer_type") not in TOKENIZER_TYPES:
        tokenizer = {}
    vocab = checked_arg(args, "vocab_size", where)
    if tokenizer.get("tokenizer_type") == "NullTokenizer" and vocab:
        vocab = vocab + 1  # its EOD, counted in here
    divisible = checked_arg(args, "make_vocab_size_divisible_by", where) or 128
    model.update(padded_vocab=padded, vocab_size=vocab or padded,
                 make_vocab_size_divisible_by=divisible * tp,
                 transformer_impl=(args.transformer_impl if getattr(args, "transformer_impl", None)
                                   in TRANSFORMER_IMPLS else "local"))
    default_head_dim = model.get("hidden_size", 0) // max(1, model.get("num_attention_heads", 1))
    if model.get("kv_channels") == default_head_dim:
        model["kv_channels"] = None  # the default head dim, as our settings say it
    if not getattr(args, "num_experts", None):
        model.pop("moe_ffn_hidden_size", None)
    parallel = picked(_PARALLEL_READ)
    if parallel.get("virtual_pipeline_model_parallel_size"):
        parallel.pop("num_layers_per_virtual_pipeline_stage", None)
    try:
        sections = {"model": ModelConfig(**model), "parallel": ParallelConfig(**parallel)}
    except (ConfigError, TypeError, ValueError) as err:
        raise InputError(f"{where}: the checkpoint's arguments describe a model this project "
                         f"cannot build ({err})") from None
    try:
        sections["data"] = SECTIONS["data"](**tokenizer)
    except (ConfigError, TypeError, ValueError):
        sections["data"] = SECTIONS["data"]()  # a tokenizer this project has no such type for
    seed = checked_arg(args, "seed", where)
    sections["training"] = SECTIONS["training"](**({"seed": seed} if seed is not None else {}))
    for name, cls in SECTIONS.items():
        sections.setdefault(name, cls())
    return sections
