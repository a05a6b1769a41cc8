"""The local norms are built in the model's dtype, as megatron's own layers are: a bf16
evaluation model (eval_jump/convert --dtype bfloat16 build no Float16Module) keeps no fp32
norm weight under bf16 activations, which torch's fused norm kernels refuse (a warning
and the unfused path). The values are the same either way (weights of ones)."""

import warnings

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from megatron_jreg.model.norm import LayerNorm, RMSNorm


@pytest.mark.parametrize("cls,normalization", [(RMSNorm, "RMSNorm"), (LayerNorm, "LayerNorm")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_weights_take_the_model_dtype(cls, normalization, dtype):
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                               params_dtype=dtype,
                               bf16=dtype == torch.bfloat16, normalization=normalization)
    norm = cls(config, 8, eps=1e-5)
    assert {p.dtype for p in norm.parameters()} == {dtype}
    x = torch.randn(3, 8, dtype=dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Cannot dispatch to fused implementation"
        out = norm(x)
    assert out.dtype == dtype
    if cls is RMSNorm:
        ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    else:
        ref = torch.nn.functional.layer_norm(x.float(), (8,), eps=1e-5)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
