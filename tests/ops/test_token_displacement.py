"""The fused displacement kernel against the float64 reference: forward, both gradients,
gradcheck, dispatch, torch.compile, and what autograd saves."""

import pytest
import torch
from devices import DEVICES

from megatron_jreg.jreg import EPS
from megatron_jreg.ops import (
    displacement,
    fused_available,
    resolve_impl,
    token_displacement,
    token_displacement_reference,
)

FP32_RTOL = 1e-6
# Relative psi error is measured down to psi = 1e-9; below that, absolutely at 1e-15.
PSI_FLOOR = 1e-9


def exact_psi(a, b):
    """psi from the inputs' values in float64 as |a/|a| - b/|b||^2 / 4 (= (1 - cos) / 2): no
    cancellation at cos -> 1, so it is exact to ~1e-11 relative at psi = 1e-9 (the unit
    vectors' rounding over their difference). Not the code under test's formula."""
    a, b = a.double().cpu(), b.double().cpu()
    unit_a = a / a.norm(dim=-1, keepdim=True)
    unit_b = b / b.norm(dim=-1, keepdim=True)
    return ((unit_a - unit_b) ** 2).sum(-1) / 4


def _psi_and_grads(a, b, impl, weight=None, mask=None):
    """psi (float64) and the gradients (float64) of sum(weight * psi) in a and b."""
    a = a.detach().clone().requires_grad_(True)
    b = b.detach().clone().requires_grad_(True)
    if mask is not None:
        loss = displacement(a, b, mask=mask, impl=impl)
        psi = token_displacement(a.detach(), b.detach(), impl=impl)
    else:
        psi = token_displacement(a, b, impl=impl)
        loss = (psi.double() * weight).sum()
    loss.backward()
    return psi.detach().double().cpu(), a.grad.double().cpu(), b.grad.double().cpu()


def _errors(got, ref, a, b, weight):
    """psi: max relative error against ``exact_psi`` (floored at PSI_FLOOR). Gradients: max
    error over the size of the terms they are built from, max |w b / (2|a||b|)| for grad a (the
    usual relative error where the terms do not cancel; at h = 1 the exact gradient is 0 and
    only that scale is meaningful)."""
    exact = exact_psi(a, b)
    psi = (got[0] - exact).abs() / exact.clamp_min(PSI_FLOOR)
    a, b = a.double().cpu(), b.double().cpu()
    w = torch.ones(a.shape[:-1], dtype=torch.float64) if weight is None else weight.double().cpu()
    norms = (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(EPS).unsqueeze(-1)
    scales = [(w.unsqueeze(-1) * x.abs() / (2 * norms)).max() for x in (b, a)]
    grads = [
        (g - r).abs().max() / torch.maximum(r.abs().max(), s).clamp_min(1e-30)
        for g, r, s in zip(got[1:], ref[1:], scales)
    ]
    return [psi.max().item() if psi.numel() else 0.0] + [float(e) for e in grads]


def _inputs(shape, dtype, device, near_parallel=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(shape, generator=gen, dtype=torch.float64)
    b = torch.randn(shape, generator=gen, dtype=torch.float64)
    if near_parallel:  # cos > 0.95 for h >= 7, like middle layers
        b = a * 1.1 + 0.1 * b
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


def _compare(a, b, weight=None, mask=None):
    """Errors of the fused kernel and of the PyTorch path in the inputs' dtype, both against
    the reference in float64 on the same (rounded) inputs."""
    if weight is None:
        gen = torch.Generator().manual_seed(1)
        weight = torch.rand(a.shape[:-1], generator=gen, dtype=torch.float64).to(a.device)
    ref = _psi_and_grads(a.double(), b.double(), "torch", weight, mask)
    fused = _psi_and_grads(a, b, "fused", weight, mask)
    torch_path = _psi_and_grads(a, b, "torch", weight, mask)
    scale_weight = weight if mask is None else mask.double() / mask.sum()
    return _errors(fused, ref, a, b, scale_weight), _errors(torch_path, ref, a, b, scale_weight)


SHAPES = [
    (37, 1),  # odd hidden sizes; 37 tokens split unevenly over the threads
    (37, 7),
    (1031, 64),
    (37, 4097),
    (5, 3, 33),  # [s, b, h]
    (13,),  # one token
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("near_parallel", [False, True], ids=["random", "parallel"])
def test_fp32_matches_float64_reference(device, shape, near_parallel):
    a, b = _inputs(shape, torch.float32, device, near_parallel)
    fused, torch_path = _compare(a, b)
    assert fused[0] <= FP32_RTOL, f"psi relative error {fused[0]:.2e}"
    # Near-parallel gradients cancel (b/|b| - c a/|a|): no fp32 computation reaches 1e-6
    # there, so the bound is also twice the fp32 PyTorch path's error.
    for name, got, bound in zip(("grad a", "grad b"), fused[1:], torch_path[1:]):
        assert got <= max(FP32_RTOL,
                          2 * bound), f"{name} relative error {got:.2e} (torch {bound:.2e})"


def _nearly_parallel(hidden, dtype, device, seed):
    """96 tokens: b = s (cos t a/|a| + sin t u) |a|, u a unit vector orthogonal to a, with
    psi = sin^2(t/2) log-spaced from 1e-9 to 1e-2 and |b|/|a| = s from 1/3 to 3; then rounded
    to ``dtype`` (exact_psi measures the rounded values)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = 96
    a = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    u = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    unit_a = a / a.norm(dim=-1, keepdim=True)
    u = u - (u * unit_a).sum(-1, keepdim=True) * unit_a
    u = u / u.norm(dim=-1, keepdim=True)
    psi = torch.logspace(-9, -2, tokens, dtype=torch.float64)
    theta = (2 * torch.asin(psi.sqrt())).unsqueeze(-1)
    scale = torch.logspace(-0.477, 0.477, tokens,
                           dtype=torch.float64)[torch.randperm(tokens, generator=gen)]
    b = scale.unsqueeze(-1) * a.norm(dim=-1,
                                     keepdim=True) * (theta.cos() * unit_a + theta.sin() * u)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hidden", [2, 7, 64, 1031, 4097])
@pytest.mark.parametrize("impl", ["fused", "torch"])
def test_nearly_parallel_psi_to_1e_minus_9(device, dtype, hidden, impl):
    """psi within 1e-6 relative of float64 math for psi from 1e-2 down to 1e-9 and norm
    ratios from 1/3 to 3, on both paths: their per-token sums are float64 (fp32 sums give
    psi ~ 1e-7 however close the vectors are). bf16 rounding moves b by ~1e-3, so there
    the smallest psi is ~1e-7."""
    a, b = _nearly_parallel(hidden, dtype, device, seed=hidden)
    exact = exact_psi(a, b)
    if dtype == torch.float32:
        assert float(exact.min()) < 2e-9 and float(exact.max()) > 5e-3
    got = token_displacement(a, b, impl=impl).double().cpu()
    error = (got - exact).abs() / exact.clamp_min(PSI_FLOOR)
    worst = int(error.argmax())
    assert float(error[worst]) <= FP32_RTOL, (
        f"relative error {float(error[worst]):.2e} at psi {float(exact[worst]):.2e}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(37, 7), (1031, 64), (37, 4097), (5, 3, 33)], ids=str)
@pytest.mark.parametrize("near_parallel", [False, True], ids=["random", "parallel"])
def test_half_within_twice_the_pytorch_error(device, dtype, shape, near_parallel):
    a, b = _inputs(shape, dtype, device, near_parallel)
    fused, torch_path = _compare(a, b)
    for name, got, bound in zip(("psi", "grad a", "grad b"), fused, torch_path):
        # psi is computed in fp32 by both paths: floor the bound at fp32 rounding
        floor = FP32_RTOL if name == "psi" else 0.0
        assert got <= max(2 * bound, floor), f"{name}: fused {got:.2e}, torch {bound:.2e}"


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs(device):
    base_a, base_b = _inputs((6, 5, 2 * 65), torch.float32, device)
    a = base_a.transpose(0, 1)[..., ::2]  # strided tokens and strided hidden dim
    b = base_b.transpose(0, 1)[..., 1::2]
    assert not a.is_contiguous()
    fused, _ = _compare(a, b)
    assert max(fused) <= FP32_RTOL, fused


@pytest.mark.parametrize("device", DEVICES)
def test_masked_tokens(device):
    a, b = _inputs((9, 4, 48), torch.float32, device)
    gen = torch.Generator().manual_seed(2)
    mask = (torch.rand(9, 4, generator=gen) > 0.4).to(device)
    fused, _ = _compare(a, b, mask=mask)
    assert max(fused) <= FP32_RTOL, fused
    # masked tokens get no gradient
    a = a.clone().requires_grad_(True)
    displacement(a, b, mask=mask, impl="fused").backward()
    assert torch.all(a.grad[~mask] == 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_zero_vectors_match_the_reference(device, dtype):
    """psi 0.5 and gradient 0 for degenerate tokens (|a||b| < EPS), no NaN anywhere."""
    a, b = _inputs((5, 16), dtype, device)
    a[0] = 0
    b[0] = 0  # both zero
    a[1] = 0  # one zero
    b[2] = 0
    a[3] *= 1e-30 if dtype == torch.float64 else 1e-20  # tiny but not zero: degenerate
    a[4] *= 1e-6  # small, not degenerate: the full gradient
    weight = torch.ones(5, dtype=torch.float64, device=device)
    ref = _psi_and_grads(a.double(), b.double(), "torch", weight)
    got = _psi_and_grads(a, b, "fused", weight)
    for g in got:
        assert torch.isfinite(g).all()
    assert torch.all(got[0][:3] == 0.5)
    assert torch.all(got[1][:4] == 0) and torch.all(got[2][:4] == 0)
    rtol = 1e-6 if dtype != torch.bfloat16 else 1e-2
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=rtol, atol=1e-7 * r.abs().max().item())


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_float64(device):
    a, b = _inputs((3, 4, 11), torch.float64, device, seed=3)
    a.requires_grad_(True)
    b.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: token_displacement(x, y, impl="fused"), (a, b))
    a2, b2 = _inputs((6, 9), torch.float64, device, near_parallel=True, seed=4)
    a2.requires_grad_(True)
    b2.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x, y: token_displacement(x, y, impl="fused"), (a2, b2))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_token_set_and_empty_hidden(device):
    a, b = _inputs((0, 8), torch.float32, device)
    assert token_displacement(a, b, impl="fused").shape == (0,)
    a, b = _inputs((3, 0), torch.float32, device)
    torch.testing.assert_close(token_displacement(a, b, impl="fused"),
                               token_displacement_reference(a, b))


def test_extension_is_built_for_cpu():
    from megatron_jreg import _C  # a failed or missing build fails here, loudly

    assert _C.EPS == EPS
    assert fused_available("cpu")
    assert not fused_available("meta")


def test_dispatch():
    a, b = _inputs((4, 8), torch.float32, "cpu")
    assert resolve_impl(a, b, "auto") == "fused"
    assert resolve_impl(a, b, "torch") == "torch"
    assert resolve_impl(a, b.double(), "auto") == "torch"  # mixed dtypes: the reference
    with pytest.raises(ValueError, match="impl must be one of"):
        token_displacement(a, b, impl="triton")
    with pytest.raises(RuntimeError, match="not built for meta"):
        token_displacement(a.to("meta"), b.to("meta"), impl="fused")
    # the CUDA path is available exactly when the extension was compiled with it
    from megatron_jreg import _C

    assert fused_available("cuda") is fused_available(torch.device("cuda",
                                                                   0)) is bool(_C.cuda_built())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_kernel_is_built_where_a_gpu_is():
    from megatron_jreg import _C

    assert _C.cuda_built(), ("a CUDA device is present but megatron_jreg._C was built without "
                             "CUDA: reinstall with nvcc on PATH (pip install --no-build-isolation "
                             "-e .)")
    assert fused_available("cuda")


def test_input_errors_say_what_was_wrong():
    a, b = _inputs((4, 8), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="same shape"):
        token_displacement(a, b[:, :4], impl="fused")
    with pytest.raises(RuntimeError, match="same dtype"):
        token_displacement(a, b.double(), impl="fused")
    with pytest.raises(RuntimeError, match="at least one dimension"):
        token_displacement(a[0, 0], b[0, 0], impl="fused")
    with pytest.raises(RuntimeError, match="float32, float16, bfloat16 or float64"):
        token_displacement(a.int(), b.int(), impl="fused")


def test_autograd_saves_only_inputs_and_per_token_scalars():
    """No [tokens, h] tensor is saved beyond a and b themselves (the model keeps them alive)."""
    a, b = _inputs((64, 96), torch.bfloat16, "cpu")
    a.requires_grad_(True)
    b.requires_grad_(True)

    def saved_bytes(impl):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            token_displacement(a, b, impl=impl).sum()
        extra = [t for t in saved if t.data_ptr() not in (a.data_ptr(), b.data_ptr())]
        return sum(t.numel() * t.element_size() for t in extra)

    assert saved_bytes("fused") == 64 * 3 * 4  # three fp32 scalars per token
    assert saved_bytes("torch") >= 2 * 64 * 96 * 8  # float64 copies of a and b


def test_torch_compile_traces_the_op():
    a, b = _inputs((5, 3, 24), torch.float32, "cpu")
    a.requires_grad_(True)
    b.requires_grad_(True)

    def loss(x, y):
        return (token_displacement(x, y, impl="fused") ** 2).mean()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    expected = loss(a, b)
    ga, gb = torch.autograd.grad(expected, (a, b))
    got = compiled(a, b)
    cga, cgb = torch.autograd.grad(got, (a, b))
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(cga, ga)
    torch.testing.assert_close(cgb, gb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["fused", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_tokens_never_give_nan_gradients(device, impl, dtype):
    """NaN and inf in masked-out tokens (e.g. padding) give psi 0 there and exactly zero
    gradient there; the counted tokens' values and gradients equal those of the same
    tokens alone (the reference on the clean rows)."""
    a, b = _inputs((6, 5, 64), dtype, device, seed=3)
    mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(4)) > 0.4
    mask[0, 0] = True
    mask = mask.to(device)
    bad_a, bad_b = a.clone(), b.clone()
    bad_a[~mask] = float("nan")
    bad_b[~mask] = float("inf")
    bad_a, bad_b = bad_a.requires_grad_(True), bad_b.requires_grad_(True)
    psi = token_displacement(bad_a, bad_b, impl=impl, mask=mask)
    loss = displacement(bad_a, bad_b, mask=mask, impl=impl)
    loss.backward()
    assert torch.isfinite(psi).all() and bool((psi[~mask] == 0).all())
    assert torch.isfinite(bad_a.grad).all() and torch.isfinite(bad_b.grad).all()
    assert bool((bad_a.grad[~mask] == 0).all()) and bool((bad_b.grad[~mask] == 0).all())
    # the counted tokens: the float64 reference over those rows only
    ra = a[mask].double().cpu().requires_grad_(True)
    rb = b[mask].double().cpu().requires_grad_(True)
    ref = token_displacement_reference(ra, rb).mean()
    ref.backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double().cpu(), ref.detach(), rtol=tol, atol=1e-6)
    scale = float(ra.grad.abs().max())
    assert float((bad_a.grad[mask].double().cpu() - ra.grad).abs().max()) <= tol * scale
    assert float((bad_b.grad[mask].double().cpu() - rb.grad).abs().max()) <= tol * scale


def test_a_zero_upstream_gradient_skips_the_token_in_the_kernel():
    """The kernel's rule behind masking: upstream gradient exactly 0 -> exactly 0, without
    reading the token (so 0 * NaN never happens); other tokens are untouched."""
    a, b = _inputs((4, 16), torch.float32, "cpu", seed=5)
    a[1] = float("nan")
    a, b = a.requires_grad_(True), b.requires_grad_(True)
    psi = token_displacement(a, b, impl="fused")
    weight = torch.tensor([1.0, 0.0, 2.0, 0.0])
    (psi * weight).sum().backward()
    assert bool((a.grad[1] == 0).all()) and bool((b.grad[1] == 0).all())
    assert bool((a.grad[3] == 0).all())
    assert float(a.grad[0].abs().max()) > 0 and float(b.grad[2].abs().max()) > 0
