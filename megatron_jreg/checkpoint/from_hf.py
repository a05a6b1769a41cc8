"""A Hugging Face causal LM as a megatron-jreg checkpoint: the inverse of ``to_hf``.

    python tools/convert_from_hf.py --hf-model DIR --save CKPT

The architecture becomes the run config's model section, the weights become megatron-core
GPTModel tensors (:mod:`.hf_families`), and the tokenizer files are copied into the
iteration; the trainer's own save writes it at iteration 0, so every ``--load`` reads it.
What the model families cannot represent is refused by name, never approximated, and the
config and ``--save`` are checked before any weight is read (:mod:`.hf_inputs`).
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Dict, List, Optional, Tuple

import torch

from megatron_jreg.atomic_write import check_output_dir, temp_dir_beside
from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.checkpoint.hf_families import FAMILY_NAMES as FAMILIES
from megatron_jreg.checkpoint.hf_families import megatron_state_dict
from megatron_jreg.checkpoint.hf_inputs import check_finite_weights, config_before_weights
from megatron_jreg.checkpoint.model_loader import init_world
from megatron_jreg.checkpoint.run_configs import launched_world_size
from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.config.run import SECTIONS
from megatron_jreg.config.yaml_settings import to_yaml
from megatron_jreg.data.tokenizers.build import HuggingFaceTokenizer, tokenizer_identity
from megatron_jreg.distributed.setup import initialize_model_parallel, seed_everything
from megatron_jreg.errors import InputError
from megatron_jreg.hf_models import CHECKPOINT_DTYPES, load_causal_lm, resolve_hf_model, torch_dtype
from megatron_jreg.model.builder import build_model
from megatron_jreg.writer_lock import output_lock

DTYPES = CHECKPOINT_DTYPES  # of the saved weights; bfloat16 sets --bf16 in the run config
# seq_length of the saved run config: the longest context, at most this (a trainer run
# sets its own --seq-length; RoPE has no weights that depend on it)
DEFAULT_SEQ_LENGTH = 2048


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _rope_parameters(config) -> Tuple[float, Optional[str]]:
    """(RoPE base, scaling type or None) of a transformers config, old and new spellings."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or {}
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if base is None:
        base = 10000.0
    return float(base), (None if kind in (None, "default") else str(kind))


def _refuse(family: str, what: str, fix: str = "") -> InputError:
    return InputError(f"the {family} model has {what}, which the {family} form here cannot "
                      f"represent{'; ' + fix if fix else ''}; it is not converted")


def model_values(config) -> Dict[str, object]:
    """ModelConfig fields for a transformers config; InputError for what cannot be built."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        name = model_type or type(config).__name__
        raise InputError(
            f"model type {name!r} is not one of the families here (Llama, Qwen3, Mixtral, "
            "GPT-2; docs/families.md): it cannot be converted")
    family = FAMILIES[model_type]
    if model_type == "gpt2":
        return _gpt2_values(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim * heads != config.hidden_size:
        raise _refuse(family, f"head_dim {head_dim} x {heads} heads != hidden size "
                      f"{config.hidden_size}", "--kv-channels other than hidden / heads is "
                      "not supported")
    base, scaling = _rope_parameters(config)
    if scaling is not None:
        raise _refuse(family, f"RoPE scaling of type {scaling!r}",
                      "only unscaled RoPE is implemented (--use-rope-scaling is not supported)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise _refuse(family, f"hidden_act {config.hidden_act!r}", "the MLP here is SwiGLU (silu)")
    if getattr(config, "attention_bias", False):
        raise _refuse(family, "attention biases (attention_bias: true)")
    if getattr(config, "mlp_bias", False):
        raise _refuse(family, "MLP biases (mlp_bias: true)")
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", model_type != "qwen3") and window:
        raise _refuse(family, f"sliding-window attention (sliding_window {window})")
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(family, "sliding-window attention layers (layer_types)")
    groups = getattr(config, "num_key_value_heads", None) or heads
    max_positions = int(config.max_position_embeddings)
    values: Dict[str, object] = dict(
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        num_attention_heads=heads, num_query_groups=groups, group_query_attention=True,
        ffn_hidden_size=config.intermediate_size, seq_length=min(max_positions, DEFAULT_SEQ_LENGTH),
        max_position_embeddings=max_positions, vocab_size=config.vocab_size,
        padded_vocab=config.vocab_size, rotary_base=_int_if_whole(base),
        norm_epsilon=float(config.rms_norm_eps),
        init_method_std=float(getattr(config, "initializer_range", 0.02)),
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=not bool(getattr(config, "tie_word_embeddings", False)),
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=model_type == "qwen3")
    if model_type == "mixtral":
        values.update(num_experts=config.num_local_experts,
                      moe_router_topk=config.num_experts_per_tok,
                      moe_ffn_hidden_size=config.intermediate_size,
                      moe_aux_loss_coeff=float(getattr(config, "router_aux_loss_coef", 0.0)))
    return values


def _int_if_whole(value: float):
    return int(value) if float(value).is_integer() else value


def _gpt2_values(config) -> Dict[str, object]:
    if config.activation_function != "gelu":
        raise _refuse("GPT-2", f"activation_function {config.activation_function!r}",
                      "the GeLU MLP here is the exact GeLU ('gelu'; --openai-gelu is not "
                      "supported)")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(config, flag, False):
            raise _refuse("GPT-2", f"{flag}: true")
    if not getattr(config, "scale_attn_weights", True):
        raise _refuse("GPT-2", "scale_attn_weights: false")
    return dict(
        num_layers=config.n_layer, hidden_size=config.n_embd, num_attention_heads=config.n_head,
        num_query_groups=None, group_query_attention=False,
        ffn_hidden_size=config.n_inner or 4 * config.n_embd,
        seq_length=min(config.n_positions, DEFAULT_SEQ_LENGTH),
        max_position_embeddings=config.n_positions, vocab_size=config.vocab_size,
        padded_vocab=config.vocab_size, norm_epsilon=float(config.layer_norm_epsilon),
        init_method_std=float(config.initializer_range), swiglu=False,
        normalization="LayerNorm", position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not bool(getattr(config, "tie_word_embeddings", True)),
        add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False)


def untied_output_layer(hf, config_untied: bool, hf_model: str, progress=print) -> bool:
    """Whether the loaded model's output layer is a tensor of its own. transformers (5.x)
    loads a distinct ``lm_head.weight`` from the files even where config.json says
    ``tie_word_embeddings: true`` (it warns and leaves them untied), so the import follows
    the model transformers built from the directory, never the config alone: a tied import
    of such a model would give other logits than ``from_pretrained`` of it."""
    head, embedding = hf.get_output_embeddings(), hf.get_input_embeddings()
    if config_untied or head is None or head.weight is embedding.weight:
        return config_untied
    if torch.equal(head.weight, embedding.weight):
        return False
    progress(f"{hf_model}: config.json ties the output layer to the embedding, but the "
             "weight files hold a distinct lm_head.weight, which transformers loads: "
             "imported untied (--untie-embeddings-and-output-weights)")
    return True


def check_split(model_cfg, tp: int, pp: int) -> None:
    """The model must split at TP x PP; InputError naming the sizes that fit otherwise."""
    if tp < 1 or pp < 1:
        raise InputError("--tensor-model-parallel-size and --pipeline-model-parallel-size "
                         "must be >= 1")
    checks = [("attention heads", model_cfg.num_attention_heads),
              ("key/value heads", model_cfg.query_groups),
              ("FFN size", model_cfg.ffn_size),
              ("vocabulary rows", model_cfg.padded_vocab_size())]
    if model_cfg.num_experts:
        checks.append(("expert FFN size", model_cfg.moe_ffn_size))
    for what, value in checks:
        if value % tp:
            raise InputError(f"{value} {what}: TP must divide {value} "
                             f"({', '.join(map(str, _divisors(value)))}); "
                             f"--tensor-model-parallel-size {tp} does not")
    layers = model_cfg.num_layers
    if layers % pp:
        raise InputError(f"{layers} layers: PP must divide {layers} "
                         f"({', '.join(map(str, _divisors(layers)))}); "
                         f"--pipeline-model-parallel-size {pp} does not")


# ---- the checkpoint -------------------------------------------------------------------------


def _check_save(save: str, final_root: str) -> None:
    """Everything the final rename needs, before any work: ``final_root`` (``save`` with
    its symlinks resolved) new or an empty directory, in a directory that takes files."""
    if os.path.exists(final_root) and (not os.path.isdir(final_root) or os.listdir(final_root)):
        raise InputError(f"--save {save}: already exists and is not an empty directory; "
                         "remove it or choose a new directory")
    check_output_dir(os.path.dirname(final_root) or ".", "--save", save)


def staged_tokenizer_identity(tokenizer_dir: str, rows: int, hf_model: str) -> str:
    """The saved tokenizer as the trainer reads it: its ids must fit the embedding's
    ``rows``; returns its identity for the run config (what resume and the tools check)."""
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    if tokenizer.vocab_size > rows:
        raise InputError(f"--hf-model {hf_model}: its tokenizer has {tokenizer.vocab_size} ids but "
                         f"the embedding only {rows} rows; the tokenizer does not belong to "
                         "these weights")
    return tokenizer_identity(tokenizer)


def run_config_yaml(model_values_: Dict[str, object], tp: int, pp: int, tokenizer_dir: str,
                    dtype: str, source: str, tokenizer_identity: Optional[str] = None) -> str:
    """The run config of the import: the architecture, the layout it was checked for, and
    the copied tokenizer (read back with the checkpoint's own ``tokenizer/``)."""
    values = {name: {} for name in SECTIONS}
    values["model"] = {**model_values_, "bf16": dtype == "bfloat16"}
    values["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    values["data"] = {"data_path": None, "tokenizer_type": "HuggingFaceTokenizer",
                      "tokenizer_model": tokenizer_dir, "imported_from": source,
                      "tokenizer_identity": tokenizer_identity}
    return to_yaml({name: cls(**values[name]) for name, cls in SECTIONS.items()})


def convert(hf_model: str, save: str, tp: int = 1, pp: int = 1, dtype: str = "float32",
            progress=print) -> Dict[str, object]:
    """Write ``hf_model`` as a checkpoint under ``save`` (a new or empty directory, filled
    by renaming a temporary sibling when whole). Returns a summary for the closing line.

    The lock of ``save`` is held throughout: a second conversion to it is refused, and one
    that takes over a SIGKILLed run's lock removes that run's staging directory."""
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype}: choose one of {sorted(DTYPES)}")
    if launched_world_size() > 1:
        raise InputError("convert_from_hf runs on one process (dist-checkpointing reshards at "
                         "load, so one process writes every layout); run it with python, not "
                         "torchrun")
    # a symlink (to an empty or a missing directory) is written through: the checkpoint is
    # staged beside its target and renamed onto it, and the lock is the target's
    final_root = os.path.realpath(save)
    with output_lock(final_root, "--save"):  # after the world check: torchrun ranks would race it
        return _convert(hf_model, save, final_root, tp, pp, dtype, progress)


def _convert(hf_model: str, save: str, final_root: str, tp: int, pp: int, dtype: str,
             progress) -> Dict[str, object]:
    import time

    t0 = time.time()
    _check_save(save, final_root)
    path = resolve_hf_model(hf_model)
    # the architecture and the config's values are checked before any weight is read
    values = model_values(config_before_weights(path, hf_model))
    check_split(ModelConfig(**values), tp, pp)
    progress(f"reading {hf_model}")
    hf, tokenizer, path = load_causal_lm(hf_model, dtype=torch.float32)
    values = model_values(hf.config)
    values["untie_embeddings_and_output_weights"] = untied_output_layer(
        hf, values["untie_embeddings_and_output_weights"], hf_model, progress)
    model_cfg = ModelConfig(**{**values, "transformer_impl": "local"})
    check_split(model_cfg, tp, pp)
    if not getattr(tokenizer, "is_fast", False):
        raise InputError(f"--hf-model {hf_model}: its tokenizer has no tokenizer.json (a slow "
                         "tokenizer only); save it with a fast tokenizer first")
    hf_state = hf.state_dict()
    check_finite_weights(hf_state, hf_model)
    state = megatron_state_dict(hf_state, model_cfg)
    del hf, hf_state

    tmp_root = temp_dir_beside(final_root)
    try:
        staged_tok = os.path.join(tmp_root, ".tokenizer")
        tokenizer.save_pretrained(staged_tok)
        final_tok = os.path.join(ckpt.iteration_dir(final_root, 0), ckpt.TOKENIZER_DIR)
        identity = staged_tokenizer_identity(staged_tok, values["vocab_size"], hf_model)
        text = run_config_yaml(values, tp, pp, final_tok, dtype, os.path.abspath(path), identity)
        torch_device = init_world("cpu")
        build_cfg = ModelConfig(**{**values, "transformer_impl": "local",
                                   "bf16": dtype == "bfloat16"})
        parallel = ParallelConfig()
        initialize_model_parallel(build_cfg, parallel)
        seed_everything(1234)  # megatron draws an init that the loaded weights replace
        (model,) = build_model(build_cfg, parallel, tracker=None)
        model.to(torch_device)
        own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
        missing, extra = sorted(own - set(state)), sorted(set(state) - own)
        if missing or extra:
            raise RuntimeError(f"weight mapping incomplete: missing {missing[:5]}, "
                               f"unexpected {extra[:5]}")
        target = torch_dtype(dtype)
        model.load_state_dict({k: v.to(target) for k, v in state.items()}, strict=False)
        progress(f"writing {save}")
        ckpt.save_checkpoint(tmp_root, 0, [model], None, None, text, {"consumed_samples": 0},
                             run_id=uuid.uuid4().hex[:8],
                             tokenizer_dir=staged_tok)
        shutil.rmtree(staged_tok)
        try:
            if os.path.isdir(final_root):
                os.rmdir(final_root)  # empty, checked above
            os.rename(tmp_root, final_root)
        except OSError:  # another process wrote --save meanwhile: its checkpoint stays
            raise InputError(f"--save {save}: another process wrote there while this "
                             "conversion ran; its files are kept, this one's removed: choose "
                             "a new directory") from None
    except BaseException:
        shutil.rmtree(tmp_root, ignore_errors=True)
        raise
    return {"family": FAMILIES[model_cfg.family], "layers": model_cfg.num_layers,
            "parameters": sum(v.numel() for v in state.values()), "seconds": time.time() - t0}
