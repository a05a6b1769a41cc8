"""Initialisation that gives the same model under every TP/PP/VPP layout.

Every logical weight is drawn from a generator seeded by (seed, its dist-checkpointing key, its
layer) and each rank keeps its slice, so runs of one seed start identical under any layout and
on any device (given the same padded vocabulary, e.g. an explicit --vocab-size). Megatron's
rules are kept: normal (0, std) weights, std / sqrt(2 L) for the output projections of
attention and MLP (experts included), norms 1, biases 0.
"""

from __future__ import annotations

import hashlib
import math

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories


def _generator_seed(seed: int, key: str, layer_offset) -> int:
    digest = hashlib.sha256(f"{seed}/{key}/{tuple(layer_offset)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _std_for(key: str, std: float, num_layers: int) -> float:
    if key.endswith("linear_proj.weight") or key.endswith("linear_fc2.weight"):
        return std / math.sqrt(2.0 * num_layers)
    return std


@torch.no_grad()
def layout_invariant_init(model_chunks, seed: int, std: float, num_layers: int) -> int:
    """Re-draw every weight matrix of the chunks; returns the number of tensors set."""
    count = 0
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        sharded = module.sharded_state_dict()
        apply_factories(sharded)  # SwiGLU's fused fc1 becomes its two logical halves (views)
        for item in nested_values(sharded):
            if not isinstance(item, ShardedTensor) or item.data is None:
                continue
            key = item.key
            if "norm" in key or item.data.dim() < 2:
                continue  # norms keep their ones; 1-D tensors are not weight matrices
            p = item.prepend_axis_num
            layer_offset = item.global_offset[:p]
            shape = item.global_shape[p:]
            # drawn on the CPU whatever the parameter's device: CUDA's generator (Philox,
            # and its element order follows the GPU's SM count) would start a GPU run from
            # other weights than the CPU run of the same seed, and two GPU models apart
            gen = torch.Generator(device="cpu")
            gen.manual_seed(_generator_seed(seed, key, layer_offset))
            full = torch.empty(shape, dtype=torch.float32, device="cpu")
            full.normal_(0.0, _std_for(key, std, num_layers), generator=gen)
            local_shape = item.local_shape[-len(shape):]  # local_shape omits the layer axis
            index = tuple(slice(o, o + n) for o, n in zip(item.global_offset[p:], local_shape))
            item.data.copy_(full[index].reshape(item.data.shape))
            count += 1
    for chunk in model_chunks:
        module = getattr(chunk, "module", chunk)
        if getattr(module, "share_embeddings_and_output_weights", False):
            # tied embeddings under PP: the last stage's copy of the embedding was taken at
            # build time, from megatron's draw; take it again from the one drawn here
            # (collective over the embedding group: every chunk of every rank calls it)
            module.setup_embeddings_and_output_layer()
    return count
