"""The weights a ModelConfig builds, as shapes, without building them (pure arithmetic: imports
neither megatron-core nor torch).

:func:`weight_shapes` gives each weight's global shape under its dist-checkpointing key (one
stack per layer weight, ``[L, ...]``; experts stacked again, ``[L, E, ...]``), so a config can
be compared with a checkpoint's ``.metadata`` (``checkpoint.claims``); :func:`parameter_count`
sizes a model before it is built (the trainer's out-of-memory line).
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

from megatron_jreg.errors import ConfigError

LAYERS = "decoder.layers."
EMBEDDING = "embedding.word_embeddings.weight"
QKV = LAYERS + "self_attention.linear_qkv.weight"
PROJ = LAYERS + "self_attention.linear_proj.weight"
FC1 = LAYERS + "mlp.linear_fc1.weight"
FC2 = LAYERS + "mlp.linear_fc2.weight"
ROUTER = LAYERS + "mlp.router.weight"
EXPERT_FC1 = LAYERS + "mlp.experts.experts.linear_fc1.weight"
EXPERT_FC2 = LAYERS + "mlp.experts.experts.linear_fc2.weight"


def _vocab_rows(model) -> int:
    """Embedding rows, or 0 where the vocabulary is not known yet (a config before its
    tokenizer is built): the layers are the size that matters then."""
    try:
        return int(model.padded_vocab_size())
    except ConfigError:
        return 0


def weight_shapes(model) -> Dict[str, Tuple[int, ...]]:
    """{dist-checkpointing key: global shape} of every weight of ``model`` (a ModelConfig)."""
    layers, hidden = model.num_layers, model.hidden_size
    heads, groups, head = model.num_attention_heads, model.query_groups, model.head_dim
    gated = 2 if model.swiglu else 1  # SwiGLU's fc1 holds the gate and the up projection
    norms = ("weight", "bias") if model.normalization == "LayerNorm" else ("weight",)
    qkv_rows = (heads + 2 * groups) * head
    rows = _vocab_rows(model)
    shapes: Dict[str, Tuple[int, ...]] = {EMBEDDING: (rows, hidden)}
    if model.position_embedding_type == "learned_absolute":
        shapes["embedding.position_embeddings.weight"] = (model.max_positions, hidden)
    for part in norms:
        shapes[f"{LAYERS}self_attention.linear_qkv.layer_norm_{part}"] = (layers, hidden)
        shapes[f"{LAYERS}mlp.linear_fc1.layer_norm_{part}"] = (layers, hidden)
        shapes[f"decoder.final_layernorm.{part}"] = (hidden,)
    shapes[QKV] = (layers, qkv_rows, hidden)
    shapes[PROJ] = (layers, hidden, heads * head)
    if model.add_bias_linear or model.add_qkv_bias:
        shapes[QKV[:-len("weight")] + "bias"] = (layers, qkv_rows)
    if model.add_bias_linear:
        shapes[PROJ[:-len("weight")] + "bias"] = (layers, hidden)
    if model.qk_layernorm:
        for which in ("q", "k"):
            for part in norms:
                shapes[f"{LAYERS}self_attention.{which}_layernorm.{part}"] = (layers, head)
    if model.num_experts:
        experts, inner = model.num_experts, model.moe_ffn_size
        shapes[ROUTER] = (layers, experts, hidden)
        shapes[EXPERT_FC1] = (layers, experts, gated * inner, hidden)
        shapes[EXPERT_FC2] = (layers, experts, hidden, inner)
    else:
        inner = model.ffn_size
        shapes[FC1] = (layers, gated * inner, hidden)
        shapes[FC2] = (layers, hidden, inner)
        if model.add_bias_linear:
            shapes[FC1[:-len("weight")] + "bias"] = (layers, gated * inner)
            shapes[FC2[:-len("weight")] + "bias"] = (layers, hidden)
    if model.untie_embeddings_and_output_weights:
        shapes["output_layer.weight"] = (rows, hidden)
    return shapes


def parameter_count(model) -> int:
    """Parameters of ``model`` (a ModelConfig), counted from :func:`weight_shapes`."""
    return sum(math.prod(shape) for shape in weight_shapes(model).values())


def bytes_per_parameter(model, training: bool) -> int:
    """Bytes a parameter takes: its dtype; in training also its fp32 gradient (and fp32 main
    copy under bf16/fp16) and Adam's two fp32 moments."""
    low = model.bf16 or model.fp16
    weight = 2 if low else 4
    if not training:
        return weight
    return weight + 4 + (4 if low else 0) + 8


def size_words(count: float) -> str:
    """``count`` in words a person reads at once: 4.9 billion, 31.2 million, 8192."""
    for scale, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million")):
        if count >= scale:
            return f"{count / scale:.1f} {word}"
    return f"{int(count)}"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
