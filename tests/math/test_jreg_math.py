"""megatron_jreg.jreg against the definitions and the worked example of the JREG spec."""

import math

import pytest
import torch

from megatron_jreg.jreg import jump_rates, layer_weights, masked_mean, regularizer
from megatron_jreg.ops import displacement, token_displacement_reference

# Worked example: three layers, one token.
H = [torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]]),
     torch.tensor([[-1.0, 0.0]])]
EXPECTED_PSI = [(1 - 1 / math.sqrt(2)) / 2, (1 - 1 / math.sqrt(2)) / 2, 0.5]


def test_worked_example_displacement():
    psi = [float(displacement(H[i], H[i + 1])) for i in range(3)]
    assert psi == pytest.approx(EXPECTED_PSI, abs=1e-7)
    assert psi[0] == pytest.approx(0.146447, abs=1e-6)


def test_worked_example_jump_rates_and_r():
    rates = jump_rates(EXPECTED_PSI)
    assert set(rates) == {2, 3}
    assert rates[3] == pytest.approx(35.3553, abs=1e-4)
    assert rates[2] == pytest.approx(35.3553, abs=1e-4)
    r = regularizer(torch.tensor(EXPECTED_PSI), layer_weights(3, 0.0))
    assert float(r) == pytest.approx(0.264298, abs=1e-6)


def test_jump_rate_sums_only_rises():
    psi = [0.2, 0.1, 0.15, 0.05, 0.3]  # rises at layers 3 (+0.05) and 5 (+0.25)
    rates = jump_rates(psi)
    assert set(rates) == {2, 3, 4, 5}
    assert rates[5] == pytest.approx(25.0)
    assert rates[4] == pytest.approx(25.0)
    assert rates[3] == pytest.approx(30.0)
    assert rates[2] == pytest.approx(30.0)
    assert jump_rates([0.5, 0.4, 0.3]) == {2: 0.0, 3: 0.0}
    assert jump_rates(torch.tensor(psi, dtype=torch.float64)) == pytest.approx(rates)


def test_nan_displacement_gives_nan_jump_rate_never_zero():
    nan = float("nan")
    rates = jump_rates([nan, nan, nan])  # e.g. a model whose weights are all NaN
    assert set(rates) == {2, 3} and all(math.isnan(z) for z in rates.values())
    # zeta_l = 100 * sum_{k >= l} max(0, Psi_k - Psi_{k-1}): NaN exactly where a term has NaN
    rates = jump_rates([0.1, nan, 0.2, 0.3, 0.25])
    assert rates[5] == 0.0 and rates[4] == pytest.approx(10.0)
    assert math.isnan(rates[3]) and math.isnan(rates[2])
    rates = jump_rates([0.1, 0.2, 0.3, nan])  # only the top layer: every zeta is NaN
    assert all(math.isnan(z) for z in rates.values())
    # a falling NaN is no "fall" either (max(0, nan - x) would be 0)
    assert math.isnan(jump_rates([0.5, nan])[2]) and math.isnan(jump_rates([nan, 0.5])[2])
    assert all(math.isnan(z) for z in jump_rates(torch.tensor([0.1, nan, 0.3])).values())
    # infinities are not finite displacements either
    assert math.isnan(jump_rates([float("inf"), 0.1])[2])
    assert math.isnan(jump_rates([0.1, float("inf")])[2])


def test_finite_jump_rates_unchanged():
    gen = torch.Generator().manual_seed(5)
    for _ in range(20):
        psi = torch.rand(7, generator=gen, dtype=torch.float64).tolist()
        expected = {
            l: 100.0 * sum(max(0.0, psi[k - 1] - psi[k - 2]) for k in range(l, 8))
            for l in range(2, 8)
        }
        rates = jump_rates(psi)
        assert rates == pytest.approx(expected, abs=1e-12)
        assert all(math.isfinite(z) and z >= 0 for z in rates.values())


def test_zero_vectors_give_half_and_no_nan():
    a = torch.zeros(3, 8, requires_grad=True)
    b = torch.randn(3, 8, requires_grad=True)
    psi = token_displacement_reference(a, b)
    assert torch.equal(psi, torch.full((3,), 0.5))
    psi.sum().backward()
    assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all()
    assert float(a.grad.abs().max()) == 0.0 and float(b.grad.abs().max()) == 0.0


def test_mask_excludes_tokens():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 5, 16, generator=gen), torch.randn(4, 5, 16, generator=gen)
    mask = torch.rand(4, 5, generator=gen) > 0.4
    per_token = token_displacement_reference(a, b)
    expected = per_token[mask].double().mean()
    got = displacement(a, b, mask=mask)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(float(expected), rel=1e-6)
    # masked-out tokens may hold anything, NaN included
    a_bad = a.clone()
    a_bad[~mask] = float("nan")
    assert float(displacement(a_bad, b, mask=mask)) == pytest.approx(float(expected), rel=1e-6)


def test_mask_errors():
    a = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="mask shape"):
        displacement(a, a, mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="counts no tokens"):
        displacement(a, a, mask=torch.zeros(2, 3, dtype=torch.bool))


def test_bf16_input_computes_in_fp32():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen)
    a16, b16 = a.bfloat16(), b.bfloat16()
    got = token_displacement_reference(a16, b16)
    assert got.dtype == torch.float32
    exact = token_displacement_reference(a16.double(), b16.double())  # same bf16 values, exact math
    assert float((got.double() - exact).abs().max()) < 1e-6
    # a bf16-accumulated cosine would be off by ~1e-2; fp32 accumulation is not
    assert float(displacement(a16, b16)) == pytest.approx(float(exact.mean()), rel=1e-5)


def test_nearly_parallel_vectors_are_accurate():
    """fp32 inputs with psi from ~1e-5 down to ~1e-9: within 1e-6 relative of psi written
    as |a/|a| - b/|b||^2 / 4 in float64 (no cancellation there), on the reference path."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(32, 512, generator=gen, dtype=torch.float64)
    step = torch.logspace(-2, -4, 32, dtype=torch.float64).unsqueeze(-1)
    b = 1.3 * a + step * torch.randn(32, 512, generator=gen, dtype=torch.float64)
    a32, b32 = a.float(), b.float()
    unit_a = a32.double() / a32.double().norm(dim=-1, keepdim=True)
    unit_b = b32.double() / b32.double().norm(dim=-1, keepdim=True)
    exact = ((unit_a - unit_b) ** 2).sum(-1) / 4
    assert float(exact.max()) < 2e-5 and float(exact.min()) < 2e-9
    got = token_displacement_reference(a32, b32).double()
    assert float(((got - exact).abs() / exact).max()) < 1e-6


def test_gradcheck_float64():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 4, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, False, True, True]] * 3)
    assert torch.autograd.gradcheck(lambda x, y: token_displacement_reference(x, y), (a, b))
    assert torch.autograd.gradcheck(lambda x, y: displacement(x, y, mask=mask, impl="torch"),
                                    (a, b))


def test_analytic_gradient():
    """d psi / d a = -(b / (|a||b|) - c a / |a|^2) / 2."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(5, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, 9, generator=gen, dtype=torch.float64)
    token_displacement_reference(a, b).sum().backward()
    na, nb = a.detach().norm(dim=-1, keepdim=True), b.norm(dim=-1, keepdim=True)
    c = (a.detach() * b).sum(-1, keepdim=True) / (na * nb)
    expected = -(b / (na * nb) - c * a.detach() / na**2) / 2
    torch.testing.assert_close(a.grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 1.0, 3.0])
def test_softmax_weights(alpha):
    w = layer_weights(12, alpha)
    expected = torch.tensor([math.exp(alpha * l) for l in range(1, 13)], dtype=torch.float64)
    expected /= expected.sum()
    assert w.dtype == torch.float32 and w.shape == (12,)
    torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=1e-9)
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)


def test_power_and_final_weights():
    w = layer_weights(4, 2.0, kind="power")
    expected = torch.tensor([1, 4, 9, 16], dtype=torch.float64) / 30
    torch.testing.assert_close(w.double(), expected, rtol=1e-6, atol=1e-9)
    assert layer_weights(4, 0.0, kind="power").tolist() == pytest.approx([0.25] * 4)
    assert layer_weights(5, 1.0, kind="final").tolist() == [0, 0, 0, 0, 1]


def _expected_weights(kind, num_layers, alpha):
    """docs/design.md's formulas in plain Python floats, normalised to sum 1."""
    layers = range(1, num_layers + 1)
    if kind == "softmax":  # w_l ∝ exp(alpha l), shifted by the largest exponent
        top = max(alpha * l for l in layers)
        raw = [math.exp(alpha * l - top) for l in layers]
    elif kind == "power":  # w_l ∝ (l / L)^alpha
        raw = [(l / num_layers) ** alpha for l in layers]
    else:  # final: w_L = 1, every other layer 0, whatever alpha
        raw = [0.0] * (num_layers - 1) + [1.0]
    total = math.fsum(raw)
    return [r / total for r in raw]


@pytest.mark.parametrize("kind", ["softmax", "power", "final"])
@pytest.mark.parametrize("num_layers", [1, 2, 3, 7, 16, 30])
@pytest.mark.parametrize("alpha", [-1.5, 0.0, 0.3, 1.0, 2.5, 7.0])
def test_weights_follow_the_design_formulas(kind, num_layers, alpha):
    """--jreg-weighting softmax|power|final at any --jreg-alpha: fp32, L entries, sum 1."""
    w = layer_weights(num_layers, alpha, kind=kind)
    assert w.dtype == torch.float32 and w.shape == (num_layers,)
    expected = _expected_weights(kind, num_layers, alpha)
    assert w.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert float(w.double().sum()) == pytest.approx(1.0, abs=1e-6)
    assert bool((w >= 0).all())
    if kind == "final" or num_layers == 1:
        assert w.tolist() == [0.0] * (num_layers - 1) + [1.0]
    elif alpha == 0.0:  # both depth weightings are uniform at alpha 0
        assert w.tolist() == pytest.approx([1.0 / num_layers] * num_layers, rel=1e-6)
    elif kind in ("softmax", "power"):  # alpha > 0 favours deep layers, alpha < 0 shallow ones
        diffs = (w[1:].double() - w[:-1].double()).tolist()  # fp32 may underflow to 0
        sign = 1 if alpha > 0 else -1
        assert all(sign * d >= 0 for d in diffs) and sign * (w[-1] - w[0]) > 0


def test_power_and_softmax_ratios_are_the_formulas():
    """The ratios, which no normalisation can change: w_l / w_L."""
    for num_layers, alpha in ((5, 0.5), (12, 2.0), (9, -1.0)):
        w = layer_weights(num_layers, alpha, kind="power").double()
        for l in range(1, num_layers + 1):
            assert float(w[l - 1] / w[-1]) == pytest.approx((l / num_layers) ** alpha, rel=1e-6)
        w = layer_weights(num_layers, alpha, kind="softmax").double()
        for l in range(1, num_layers + 1):
            assert float(w[l - 1] / w[-1]) == pytest.approx(
                math.exp(alpha * (l - num_layers)), rel=1e-6
            )


def test_large_alpha_concentrates_on_last_layer():
    w = layer_weights(30, 50.0)
    assert float(w[-1]) == pytest.approx(1.0, abs=1e-6)


def test_weight_errors():
    with pytest.raises(ValueError, match="unknown weighting"):
        layer_weights(4, 1.0, kind="linear")
    with pytest.raises(ValueError, match="num_layers"):
        layer_weights(0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        layer_weights(4, float("nan"))


def test_module_has_no_megatron_or_distributed_imports():
    import ast
    import inspect

    import megatron_jreg.jreg as module

    tree = ast.parse(inspect.getsource(module))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and node.module]
    assert not [n for n in names if n.startswith("megatron.") or "distributed" in n], names


def test_jreg_does_not_import_the_ops():
    """ops imports jreg (EPS, the masked mean), never the other way round."""
    import ast
    import inspect

    import megatron_jreg.jreg as module

    tree = ast.parse(inspect.getsource(module))
    names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names]
    names += [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
              and node.module]
    assert not [n for n in names if n.startswith("megatron_jreg.ops")], names


def test_masked_mean_counts_and_shares():
    gen = torch.Generator().manual_seed(6)
    psi = torch.rand(4, 3, generator=gen)
    mask = torch.rand(4, 3, generator=gen) > 0.5
    mask[0, 0] = True
    assert float(masked_mean(psi)) == pytest.approx(float(psi.mean()), rel=1e-7)
    assert float(masked_mean(psi, mask)) == pytest.approx(float(psi[mask].mean()), rel=1e-6)
    # a slice of the tokens over the global count: its share of the mean
    halves = [masked_mean(psi[:2], mask[:2], int(mask.sum())),
              masked_mean(psi[2:], mask[2:], int(mask.sum()))]
    assert float(sum(halves)) == pytest.approx(float(psi[mask].mean()), rel=1e-6)
    with pytest.raises(ValueError, match="counts no tokens"):
        masked_mean(psi, torch.zeros(4, 3, dtype=torch.bool))


def test_regularizer_of_logged_values_is_a_double_sum():
    w = layer_weights(3, 1.0)
    psi = [0.1, 0.2, 0.3]
    r = regularizer(psi, w)
    assert isinstance(r, float)
    assert r == sum(wl * p for wl, p in zip(w.tolist(), psi))
    assert r == pytest.approx(float(regularizer(torch.tensor(psi), w)), rel=1e-6)
    with pytest.raises(ValueError, match="2 displacements for 3 weights"):
        regularizer([0.1, 0.2], w)


@pytest.mark.parametrize("kind, alpha, one_hot_at", [("power", -250.0, 0), ("power", 1e5, -1),
                                                     ("softmax", 1e308, -1),
                                                     ("softmax", -1e308, 0)])
def test_extreme_finite_alpha_gives_the_one_hot_limit_not_nan(kind, alpha, one_hot_at):
    """(l/L)^alpha and exp(alpha l) overflow for large |alpha|; the weights must still be the
    limit (all weight on the first or last layer), never NaN (a NaN weight makes the loss NaN)."""
    w = layer_weights(30, alpha, kind)
    expected = torch.zeros(30)
    expected[one_hot_at] = 1.0
    assert torch.isfinite(w).all() and torch.equal(w.float(), expected)
