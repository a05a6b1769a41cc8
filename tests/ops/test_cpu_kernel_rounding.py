"""The CPU kernel's backward in bf16: its vectorised rounding equals torch's own conversion
of the fp32 formula, value for value, in the vector body and in the tail past the last
vector; NaN is stored as c10's 0x7FC0."""

import torch

from megatron_jreg.ops import fused_available  # also registers torch.ops.megatron_jreg


def _fused_grads(a, b, g):
    assert fused_available("cpu")
    _, stats = torch.ops.megatron_jreg.token_displacement_fwd(a, b)
    ga, gb = torch.ops.megatron_jreg.token_displacement_bwd(g, a, b, stats)
    return ga, gb, stats


def _formula(a, b, g, stats):
    """(ga, gb) in fp32: inv*b - ka*a and inv*a - kb*b, with inv, ka, kb times -g/2."""
    gcos = -0.5 * g
    inv, ka, kb = ((gcos * stats[:, k]).unsqueeze(-1) for k in range(3))
    x, y = a.float(), b.float()
    return inv * y - ka * x, inv * x - kb * y


def test_bf16_gradients_are_the_fp32_formula_rounded_to_nearest_even():
    gen = torch.Generator().manual_seed(7)
    tokens, hidden = 1024, 8 * 37 + 5  # 37 vectors of 8 lanes and a tail of 5
    a = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    b = (a.float() * 0.9 + 0.5 * torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16)
    g = torch.randn(tokens, generator=gen) * torch.logspace(-30, 30, tokens)  # every magnitude
    ga, gb, stats = _fused_grads(a, b, g)
    exact = _formula(a, b, g, stats)
    ties = sum(int(((e.view(torch.int32) & 0xFFFF) == 0x8000).sum()) for e in exact)
    assert ties > 0, "no result lies halfway between two bf16 values: the data hold no ties"
    assert torch.equal(ga, exact[0].to(torch.bfloat16))
    assert torch.equal(gb, exact[1].to(torch.bfloat16))


def test_bf16_nan_gradient_is_c10_quiet_nan():
    """NaN in a counted token's input gives NaN gradients, stored as 0x7FC0 (c10's NaN)."""
    a = torch.randn(3, 20, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    b = a.flip(-1).clone()
    a[1, 3] = float("nan")
    ga, gb, _ = _fused_grads(a, b, torch.ones(3))
    for grad in (ga, gb):
        assert bool(torch.isnan(grad[1, 3])) and int(grad[1, 3].view(torch.int16)) == 0x7FC0
        assert int(torch.isnan(grad).sum()) == 1
