"""Shape rules megatron-core meets only while it builds the model or runs its first forward,
checked where the settings are read, each failure one line naming the flags and values that
fit: :func:`check_head_size` (``ModelConfig``) and :func:`check_tensor_split` (the trainer's
layout check, ``ExperimentConfig._check_layout``).
"""

from __future__ import annotations

from typing import List

from megatron_jreg.errors import ConfigError


def near_multiples(value: int, step: int) -> List[int]:
    """The multiples of ``step`` just below and just above ``value`` (those above 0)."""
    lower = value - value % step
    return [v for v in (lower, lower + step) if v > 0]


def check_head_size(model) -> None:
    """The head size of ``model`` (a ModelConfig): --kv-channels, when given, must be
    hidden / heads, and rotary embeddings need it even: megatron-core's RotaryEmbedding has
    one frequency per pair of channels, ceil(d / 2) of them, and an odd head size of 17
    meets 18 rotary channels at the first forward."""
    heads, hidden, head = model.num_attention_heads, model.hidden_size, model.head_dim
    if model.kv_channels not in (None, head):
        raise ConfigError(f"--kv-channels {model.kv_channels}: not supported yet; the head dim "
                          f"is --hidden-size / --num-attention-heads = {head}; drop "
                          "--kv-channels")
    if model.position_embedding_type == "rope" and head % 2:
        fits = " or ".join(f"--hidden-size {h}" for h in near_multiples(hidden, 2 * heads))
        raise ConfigError(f"--hidden-size {hidden} with --num-attention-heads {heads} gives a "
                          f"head size of {head}; rotary embeddings need an even head size: "
                          f"e.g. {fits}")


def check_tensor_split(model, tp: int) -> None:
    """The MLP's inner size must split evenly over ``tp`` tensor-parallel ranks (megatron-core's
    RowParallelLinear asserts it while building the layer): the dense MLP's, or each
    expert's in a mixture-of-experts model (its experts are split over the same TP ranks,
    and it has no dense MLP)."""
    if model.num_experts:
        size, flag = model.moe_ffn_size, "--moe-ffn-hidden-size"
        what = "each expert's MLP inner size"
    else:
        size, flag, what = model.ffn_size, "--ffn-hidden-size", "the MLP's inner size"
    if size % tp:
        fits = " or ".join(f"{flag} {v}" for v in near_multiples(size, tp))
        # a smaller TP that splits the whole layer: the fix when the sizes are a checkpoint's
        # (--use-checkpoint-args), which no flag changes
        smaller = max(d for d in range(1, tp) if not (size % d or model.num_attention_heads % d
                                                      or model.query_groups % d))
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide {what} {size} "
                          f"({flag}; each TP rank holds an equal share): e.g. {fits}, or "
                          f"--tensor-model-parallel-size {smaller}")
