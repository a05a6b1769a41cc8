"""attach_penalty: identity forward; backward hands the penalty the gradient ``scale``."""

import torch

from megatron_jreg.ops import attach_penalty


def test_attach_penalty_is_identity_and_injects_scaled_gradient():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    h = x * 2.0
    penalty = (x ** 2).sum() * 0.5  # d penalty / dx = x
    out = attach_penalty(h, penalty, 0.25)
    assert torch.equal(out, h)
    out.sum().backward()
    # d/dx of sum(2x) + 0.25 * penalty = 2 + 0.25 x
    torch.testing.assert_close(x.grad, 2.0 + 0.25 * x.detach(), rtol=0, atol=0)


def test_attach_penalty_matches_adding_the_scaled_loss():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=gen, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    scale = 3.0
    (attach_penalty(torch.tanh(x), x.pow(2).mean(), scale) ** 2).sum().backward()
    ((torch.tanh(y) ** 2).sum() + scale * y.pow(2).mean()).backward()
    torch.testing.assert_close(x.grad, y.grad)
