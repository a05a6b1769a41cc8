"""SDPAttention (model/attention.py) against megatron-core's DotProductAttention: the same
output and the same gradients of query, key and value (fp32, 1e-6), for multi-head and
grouped-query attention, with the causal mask and with an explicit padding mask."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_jreg.distributed.setup import (initialize_distributed, initialize_model_parallel,
                                             seed_everything)
from megatron_jreg.model.attention import SDPAttention, resolve_attention_backend
from megatron_jreg.model.config import ModelConfig, ParallelConfig

S, B, HEAD_DIM = 12, 3, 8


@pytest.fixture(scope="module", autouse=True)
def world():
    initialize_distributed()
    initialize_model_parallel(ModelConfig.from_preset("tiny", vocab_size=128), ParallelConfig())
    seed_everything(1)  # megatron's dropout runs under the model-parallel RNG tracker


def _config(heads, groups):
    return TransformerConfig(num_layers=1, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=HEAD_DIM, attention_dropout=0.0,
                             masked_softmax_fusion=False)


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_sdpa_equals_megatrons_attention(heads, groups, mask_type):
    config = _config(heads, groups)
    ours = SDPAttention(config, 1, mask_type, "self")
    theirs = DotProductAttention(config, 1, mask_type, "self")
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    q = torch.randn(S, B, heads, HEAD_DIM, generator=gen)
    k = torch.randn(S, B, groups, HEAD_DIM, generator=gen)
    v = torch.randn(S, B, groups, HEAD_DIM, generator=gen)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]  # True = masked
    if mask_type == AttnMaskType.padding:  # causal, and the last 3 keys of batch 0 padded
        mask = mask.repeat(B, 1, 1, 1)
        mask[0, :, :, -3:] = True
        mask[0, :, -3:, :] = False  # every query keeps a key (no all-masked rows)
        mask[0, :, -3:, -3:] = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
    grads, outs = [], []
    for module in (ours, theirs):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = module(qq, kk, vv, mask, attn_mask_type=mask_type)
        assert out.shape == (S, B, heads * HEAD_DIM)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in (qq, kk, vv)])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_backend_choice():
    assert resolve_attention_backend("auto", "local", "cuda")[0] == "sdpa"
    assert resolve_attention_backend("auto", "local", "cpu")[0] == "megatron"
    assert resolve_attention_backend("auto", "transformer_engine", "cuda")[0] == "transformer_engine"
    assert resolve_attention_backend("flash", "local", "cuda")[0] == "sdpa"
    assert resolve_attention_backend("unfused", "local", "cuda")[0] == "megatron"
    assert resolve_attention_backend("sdpa", "transformer_engine", "cpu")[0] == "sdpa"
    assert resolve_attention_backend("local", "transformer_engine", "cuda")[0] == "megatron"
