"""causal_attention_mask: one tensor per (length, device), shared by every micro-batch."""

import torch

from megatron_jreg.model.builder import causal_attention_mask


def test_one_tensor_per_length_and_device():
    a = causal_attention_mask(16, device=torch.device("cpu"))
    assert causal_attention_mask(16, device="cpu") is a
    assert causal_attention_mask(16) is a
    assert a.shape == (1, 1, 16, 16) and a.dtype == torch.bool
    assert torch.equal(a[0, 0], torch.triu(torch.ones(16, 16, dtype=torch.bool), 1))
    other = causal_attention_mask(8, device="cpu")
    assert other is not a and other.shape == (1, 1, 8, 8)
    meta = causal_attention_mask(16, device="meta")
    assert meta is not a and meta.device.type == "meta"
