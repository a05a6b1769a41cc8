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


def test_a_scale_on_the_device_gives_the_gradient_of_the_same_number():
    """The trainer hands the optimizer's loss scale as a 0-dim tensor (read where it lives,
    without waiting for it): the gradient is the one of the number it holds."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    scale = torch.tensor([65536.0 / 3])  # an fp16 loss scale over 3 micro-batches, shape [1]
    attach_penalty(torch.tanh(x), x.pow(2).mean(), scale).sum().backward()
    attach_penalty(torch.tanh(y), y.pow(2).mean(), float(scale)).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=0)
    assert x.grad.dtype == torch.float64
