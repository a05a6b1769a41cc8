"""SDPAttention (model/attention.py) against megatron-core's DotProductAttention: the same
output and the same gradients of query, key and value (fp32, 1e-6), for multi-head and
grouped-query attention, with the causal mask and with an explicit padding mask. Grouped
K/V go to SDPA as they are (``enable_gqa``), with the numbers of the expanded ones."""

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_jreg.config.model import ModelConfig, ParallelConfig, resolve_attention_backend
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model import attention
from megatron_jreg.model.attention import SDPAttention

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
    assert resolve_attention_backend("auto", "local")[0] == "sdpa"  # on every device
    assert resolve_attention_backend("auto", "transformer_engine")[0] == "transformer_engine"
    assert resolve_attention_backend("flash", "local")[0] == "sdpa"
    assert resolve_attention_backend("unfused", "local")[0] == "megatron"
    assert resolve_attention_backend("sdpa", "transformer_engine")[0] == "sdpa"
    assert resolve_attention_backend("local", "transformer_engine")[0] == "megatron"


def _inputs(heads, groups, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(S, B, heads, HEAD_DIM, generator=gen),
            torch.randn(S, B, groups, HEAD_DIM, generator=gen),
            torch.randn(S, B, groups, HEAD_DIM, generator=gen))


def _run(module, q, k, v, mask, mask_type):
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    out = module(qq, kk, vv, mask, attn_mask_type=mask_type)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return [out.detach()] + [t.grad for t in (qq, kk, vv)]


@pytest.mark.parametrize("groups", [2, 1])
@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_grouped_kv_read_in_place_equal_the_expanded_ones(groups, mask_type, monkeypatch):
    """enable_gqa against K/V expanded with repeat_interleave (the path a GPU takes where
    FlashAttention cannot run): the same output and gradients, fp32."""
    module = SDPAttention(_config(4, groups), 1, mask_type, "self")
    q, k, v = _inputs(4, groups, 7)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
    in_place = _run(module, q, k, v, mask, mask_type)
    monkeypatch.setattr(attention, "sdpa_reads_groups", lambda *args: False)
    expanded = _run(module, q, k, v, mask, mask_type)
    for a, b in zip(in_place, expanded):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_grouped_kv_are_not_expanded(mask_type, monkeypatch):
    module = SDPAttention(_config(4, 2), 1, mask_type, "self")
    q, k, v = _inputs(4, 2, 3)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]

    def refuse(*args, **kwargs):
        raise AssertionError("K/V were expanded with repeat_interleave")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", refuse)
    monkeypatch.setattr(torch, "repeat_interleave", refuse)
    out, dq, dk, dv = _run(module, q, k, v, mask, mask_type)
    assert dk.shape == k.shape and torch.isfinite(out).all()


def test_the_gpu_check_is_pytorchs_flash_dispatch_check():
    """sdpa_reads_groups asks PyTorch's own FlashAttention check on a GPU: its parameters
    take enable_gqa (the call runs here on CPU tensors, where it answers False)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in _inputs(4, 2, 5))
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, True)
    assert params.enable_gqa is True
    assert torch.backends.cuda.can_use_flash_attention(params) is False
    assert attention.sdpa_reads_groups(q, k, v, None, 0.0, True)  # the CPU flash kernel
    assert not attention.sdpa_reads_groups(q.to("meta"), k.to("meta"), v.to("meta"), None, 0.0,
                                           True)
