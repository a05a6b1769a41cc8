"""Core attention through PyTorch's ``scaled_dot_product_attention`` for the local spec.

:class:`SDPAttention` has the constructor, inputs and output of megatron-core's local
``DotProductAttention`` and is swapped in through the layer spec (``model.builder``). Shapes:
query [sq, b, np, hn], key and value [sk, b, ng, hn] (this rank's heads and query groups, and
its part of the sequence under context parallelism: ``model.context_parallel``); output
[sq, b, np * hn].
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from megatron_jreg.model import context_parallel


def sdpa_reads_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: Optional[torch.Tensor], dropout: float, causal: bool) -> bool:
    """Whether SDPA's kernel for these inputs takes K/V with fewer heads than Q
    (``enable_gqa``) without expanding them.

    On CPUs its flash kernel does, masked or not. On GPUs only FlashAttention does (and the
    math kernel, which expands them itself and builds the score matrix): where
    FlashAttention cannot run (fp32, an explicit mask), enable_gqa would leave only the math
    kernel, so K/V are expanded for the memory-efficient one instead. Asked of PyTorch's
    own dispatch check."""
    if q.device.type == "cpu":
        return True
    if q.device.type != "cuda" or not torch.backends.cuda.flash_sdp_enabled():
        return False
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, dropout, causal, True)
    return torch.backends.cuda.can_use_flash_attention(params)


class SDPAttention(MegatronModule):
    """megatron's core-attention interface over ``scaled_dot_product_attention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        if config.context_parallel_size > 1 and cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"SDPA attention: --cp-comm-type {cp_comm_type} needs Transformer "
                             "Engine's attention; this one all-gathers keys and values "
                             "(all_gather)")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"SDPA attention: softmax_type {config.softmax_type!r} is not supported")
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPA attention: sliding-window attention is not supported")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"SDPA attention: mask type {attn_mask_type} is not supported")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        # context parallelism: this rank's two chunks of the sequence attend over all of it
        self.cp_group = pg_collection.cp if config.context_parallel_size > 1 else None
        if self.cp_group is not None and attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPA attention: mask type {attn_mask_type} under context "
                             "parallelism is not supported (causal only)")
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # megatron's scale: 1/sqrt(head dim) unless given (query-key layer scaling divides
        # the scores by the layer number and multiplies them back inside its softmax)
        self.softmax_scale = (1.0 / math.sqrt(config.kv_channels) if softmax_scale is None
                              else softmax_scale)
        self.dropout_p = (config.attention_dropout if attention_dropout is None
                          else attention_dropout)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor],
                attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params=None) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError(
                "SDPA attention: packed sequences and attention bias are not supported")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, b = query.shape[:2]
        if self.cp_group is not None:  # the whole sequence's keys and values, in order
            key, value = (context_parallel.gather_sequence(t, self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, n, s, hn]
        causal = mask_type == AttnMaskType.causal
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron: True = masked out; SDPA: True = attend
        # causal: the causal mask, like Transformer Engine does with this mask type (the
        # trainer's mask is the causal one; FlashAttention takes no explicit mask)
        dropout = self.dropout_p if self.training else 0.0
        # Query head i reads key/value group i // (heads / groups) in megatron and in SDPA's
        # enable_gqa alike. The kernel reads the groups in place where it can; else they
        # are expanded here, as megatron does.
        gqa = self.heads != self.groups
        if gqa and not sdpa_reads_groups(q, k, v, mask, dropout, causal and self.cp_group is None):
            k = k.repeat_interleave(self.heads // self.groups, dim=1)  # [b, np, sk, hn]
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
            gqa = False

        def attend():
            if self.cp_group is not None:
                return context_parallel.attend(q, k, v, self.cp_group.size(), self.cp_group.rank(),
                                               self.softmax_scale, dropout, gqa)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal, scale=self.softmax_scale,
                                                  enable_gqa=gqa)

        if dropout > 0.0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # as megatron's dropout
                context = attend()
        else:
            context = attend()
        return context.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np * hn]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters (vanilla softmax)
