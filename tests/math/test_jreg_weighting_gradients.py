"""The JREG penalty and its gradient, for every weighting and several alpha, against the
definition written out here in float64 autograd:

    w_l(alpha): softmax  w_l ∝ exp(alpha l);  power  w_l ∝ (l / L)^alpha;  final  w_L = 1
    Psi_l = mean over counted tokens t of (1 - cos(h_{l-1,t}, h_{l,t})) / 2
    penalty = lambda * sum_l w_l Psi_l

(docs/design.md). The package side is what the trainer runs: ``JregTracker.observe`` per
layer on fp32 hidden states (both displacement kernels), which attaches each layer's
penalty to the layer's output, then ``JregTracker.reduce`` for the logged values. One case
also goes through a tiny model's own layers (``JregTransformerLayer``), whose parameter
gradients are compared with those of the reference penalty on the same hidden states.
"""

import math

import pytest
import torch

from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
from megatron_jreg.distributed.setup import initialize_distributed, initialize_model_parallel
from megatron_jreg.jreg import WEIGHTINGS
from megatron_jreg.model.jreg_layer import JregTracker

L, S, B, H = 4, 7, 3, 16
LAM = 0.7


def reference_weights(kind, alpha, num_layers):
    """w_1..w_L in float64, the formulas of docs/design.md, normalised to sum 1."""
    layer = torch.arange(1, num_layers + 1, dtype=torch.float64)
    if kind == "softmax":
        raw = torch.exp(alpha * layer)
    elif kind == "power":
        raw = (layer / num_layers) ** alpha
    elif kind == "final":
        raw = (layer == num_layers).to(torch.float64)
    else:
        raise AssertionError(f"no reference for the weighting {kind!r}")
    return raw / raw.sum()


def reference_penalty(states, weights, lam, mask=None):
    """(penalty, [Psi_l]) of float64 ``states`` h_0..h_L ([s, b, h]); ``mask`` [s, b] bool."""
    psis = []
    for prev, nxt in zip(states[:-1], states[1:]):
        cos = (prev * nxt).sum(-1) / (prev.norm(dim=-1) * nxt.norm(dim=-1))
        psi = (1.0 - cos) / 2.0
        psis.append(psi.mean() if mask is None else psi[mask].mean())
    penalty = lam * sum(w * p for w, p in zip(weights, psis))
    return penalty, psis


def hidden_states(seed):
    """h_0..h_L, each layer a moderate step from the one before (as residual layers move)."""
    gen = torch.Generator().manual_seed(seed)
    states = [torch.randn(S, B, H, generator=gen, dtype=torch.float64)]
    for _ in range(L):
        states.append(states[-1] + 0.6 * torch.randn(S, B, H, generator=gen, dtype=torch.float64))
    return states


# [s, b]: the padding of two sequences of the micro-batch (True = counted)
MASK = torch.ones(S, B, dtype=torch.bool)
MASK[5:, 0] = False
MASK[2:, 2] = False


@pytest.fixture(scope="module", autouse=True)
def world():
    """A world of one with megatron's groups: the tracker reads the TP rank for a mask."""
    initialize_distributed()
    initialize_model_parallel(ModelConfig.from_preset("tiny", vocab_size=128), ParallelConfig())


def package_penalty(states, kind, alpha, impl, mask):
    """The trainer's path on fp32 copies of ``states``: (gradients w.r.t. h_0..h_L, reduce())."""
    tracker = JregTracker(JregConfig(lam=LAM, alpha=alpha, weighting=kind, impl=impl), L)
    tracker.reset()
    tracker.set_loss_scale(1.0, 1)
    tracker.set_token_mask(None if mask is None else mask.t())  # the data's [b, s]
    leaves = [h.float().requires_grad_() for h in states]
    out = leaves[0]
    for layer in range(1, L + 1):  # a layer's input is the previous layer's output
        out = tracker.observe(layer, out, leaves[layer])
    # the main loss contributes nothing: every gradient is the attached penalties'
    grads = torch.autograd.grad(out, leaves, grad_outputs=torch.zeros_like(out))
    return grads, tracker.reduce()


CASES = [(kind, alpha) for kind in ("softmax", "power") for alpha in (-1.0, 0.0, 0.5, 1.0, 2.0)]
CASES += [("final", 0.0), ("final", 2.0)]


def test_every_weighting_has_a_case():
    assert {kind for kind, _ in CASES} == set(WEIGHTINGS)


@pytest.mark.parametrize("impl", ["fused", "torch"])
@pytest.mark.parametrize("masked", [False, True], ids=["all-tokens", "padding"])
@pytest.mark.parametrize("kind, alpha", CASES)
def test_penalty_and_gradient_equal_float64_autograd(kind, alpha, impl, masked):
    states = hidden_states(seed=len(CASES) * masked + CASES.index((kind, alpha)))
    mask = MASK if masked else None
    weights = reference_weights(kind, alpha, L)
    leaves = [h.clone().requires_grad_() for h in states]
    penalty, psis = reference_penalty(leaves, weights, LAM, mask)
    expected = torch.autograd.grad(penalty, leaves)

    grads, logged = package_penalty(states, kind, alpha, impl, mask)
    assert logged["psi"] == pytest.approx([float(p.detach()) for p in psis], rel=1e-5)
    assert logged["R"] == pytest.approx(float(penalty.detach()) / LAM, rel=1e-5)
    assert logged["penalty"] == pytest.approx(float(penalty.detach()), rel=1e-5)
    for layer, (got, want) in enumerate(zip(grads, expected)):
        assert got.dtype == torch.float32
        scale = float(want.abs().max())
        if kind == "final" and layer < L - 1:
            assert scale == 0.0  # only h_{L-1} and h_L enter the final layer's Psi
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6 * scale,
                                   msg=lambda m, layer=layer: f"d penalty / d h_{layer}: {m}")
        if masked:  # padding tokens get exactly zero gradient
            assert not got[~MASK].any()


def test_alpha_moves_the_gradient_between_layers():
    """h_0 enters only Psi_1 and h_L only Psi_L, so |d/dh_0| / |d/dh_L| is w_1 / w_L times
    a factor the weights do not change: against alpha 0 it moves by e^(alpha (1 - L)) for
    softmax and by (1 / L)^alpha for power."""
    states = hidden_states(seed=99)
    ratios = {}
    for kind, alpha in (("softmax", 0.0), ("softmax", 1.0), ("power", 2.0)):
        grads, _ = package_penalty(states, kind, alpha, "fused", None)
        ratios[kind, alpha] = float(grads[0].norm() / grads[-1].norm())
    base = ratios["softmax", 0.0]
    assert ratios["softmax", 1.0] / base == pytest.approx(math.exp(1.0 - L), rel=1e-5)
    assert ratios["power", 2.0] / base == pytest.approx((1 / L) ** 2, rel=1e-5)


def test_model_layers_inject_the_reference_gradient():
    """A tiny model whose layers carry the penalty (power, alpha 1.5, fused kernel, a padded
    micro-batch): its parameter gradients from the penalty alone equal those of the
    reference penalty computed in float64 on the same run's per-layer hidden states."""
    from megatron_jreg.distributed.setup import seed_everything
    from megatron_jreg.model.builder import build_model, causal_attention_mask, transformer_config

    seq, vocab, kind, alpha = 12, 128, "power", 1.5
    model_cfg = ModelConfig.from_preset("tiny", vocab_size=vocab, seq_length=seq)
    parallel = ParallelConfig()
    initialize_model_parallel(model_cfg, parallel)
    seed_everything(7)
    tracker = JregTracker(JregConfig(lam=LAM, alpha=alpha, weighting=kind, impl="fused"),
                          model_cfg.num_layers)
    model = build_model(model_cfg, parallel, tracker, transformer_config(model_cfg, parallel))[0]
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, vocab, (2, seq), generator=gen)
    positions = torch.arange(seq).expand(2, seq)
    token_mask = torch.ones(2, seq, dtype=torch.bool)
    token_mask[1, 8:] = False  # [b, s]
    layers = model.decoder.layers

    def param_grads(with_tracker):
        states = []

        def capture(module, args, kwargs, output):
            if not states:
                states.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])
            states.append(output[0])

        hooks = [layer.register_forward_hook(capture, with_kwargs=True) for layer in layers]
        for layer in layers:
            layer.jreg_tracker = tracker if with_tracker else None
        tracker.reset()
        tracker.set_loss_scale(1.0, 1)
        tracker.set_token_mask(token_mask)
        model.zero_grad(set_to_none=True)
        logits = model(tokens, positions, causal_attention_mask(seq))
        loss = (logits * 0.0).sum()  # no language-model gradient
        if not with_tracker:
            weights = reference_weights(kind, alpha, len(layers))
            penalty, _ = reference_penalty([h.double() for h in states], weights, LAM,
                                           token_mask.t())
            loss = loss + penalty.float()
        loss.backward()
        for hook in hooks:
            hook.remove()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    got, want = param_grads(True), param_grads(False)
    for layer in layers:
        layer.jreg_tracker = tracker
    assert got.keys() == want.keys()
    # every layer's parameters get the penalty's gradient; the final norm and the output
    # layer, after the last layer, get none
    reached = {name for name, ref in want.items() if ref.any()}
    assert all(("decoder.layers." in name or "embedding" in name) == (name in reached)
               for name in want), sorted(set(want) - reached)
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")
