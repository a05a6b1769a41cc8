"""The JREG math as pure functions: displacement, jump rates, layer weights.

Definitions (Shibata et al., "Suppressing Final Layer Hidden State Jumps in Transformer
Pretraining"):

    psi_l(token) = (1 - cos(h_{l-1}, h_l)) / 2                      in [0, 1]
    Psi_l        = mean of psi_l over counted (unmasked) tokens
    zeta_l       = 100 * sum_{k=l..L} max(0, Psi_k - Psi_{k-1}),     2 <= l <= L
                   (NaN when any Psi_k, k >= l-1, is not finite; never 0)
    R            = sum_l w_l(alpha) * Psi_l,   L_total = L_CE + lambda * R

This module imports neither megatron nor torch.distributed: anyone can read and test it.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Sequence, Union

import torch

# Floor on |a| * |b| in the cosine; a zero vector gives cos = 0 (psi = 0.5), never NaN.
EPS = 1e-8


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs; float64 stays float64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_displacement_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-token psi = (1 - cos(a, b)) / 2 over the last dimension, in plain PyTorch.

    a, b: [..., h] of any float dtype. Returns [...] in fp32 (float64 for float64 input).
    This is the reference that the fused kernel in ``megatron_jreg.ops`` is tested against.
    """
    if a.shape != b.shape:
        raise ValueError(f"token_displacement: shapes differ, {tuple(a.shape)} vs {tuple(b.shape)}")
    dtype = _compute_dtype(torch.promote_types(a.dtype, b.dtype))
    a = a.to(dtype)
    b = b.to(dtype)
    dot = (a * b).sum(-1)
    aa = (a * a).sum(-1)
    bb = (b * b).sum(-1)
    # Where |a||b| < EPS the cosine is dot / EPS (0 for a zero vector) and is held constant:
    # such a token has no direction to move, so its gradient is 0 (never NaN or 1/EPS).
    product = aa * bb
    degenerate = product < EPS * EPS
    norm_product = torch.sqrt(torch.where(degenerate, torch.ones_like(product), product))
    cos = torch.where(degenerate, (dot / EPS).detach(), dot / norm_product)
    return (1.0 - cos) * 0.5


def displacement(
    h_prev: torch.Tensor,
    h_next: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Mean psi over the counted tokens, a 0-dim fp32 tensor (differentiable).

    h_prev, h_next: [..., h]; mask: [...] bool, True = counted (None counts every token).
    impl: "auto" | "fused" | "torch", passed to ``megatron_jreg.ops.token_displacement``.
    Masked-out tokens never affect the value or the gradients, whatever they hold.
    """
    from megatron_jreg.ops import token_displacement

    # masked-out tokens give psi 0 and zero gradient even when they hold NaN
    psi = token_displacement(h_prev, h_next, impl=impl, mask=mask)
    if mask is None:
        return psi.mean()
    count = int(mask.sum())
    if count == 0:
        raise ValueError("displacement: the mask counts no tokens; at least one must be True")
    return psi.sum() / count


def masked_sum(psi: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Sum of per-token ``psi`` over the tokens ``mask`` counts (all when None).

    mask: bool with psi's shape, True = counted. Masked-out tokens may hold anything (NaN
    included): they are selected away, not multiplied by zero.
    """
    if mask is None:
        return psi.sum()
    if mask.shape != psi.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal the token shape {tuple(psi.shape)} "
            "(the hidden states' shape without the last dimension)"
        )
    mask = mask.to(device=psi.device, dtype=torch.bool)
    return torch.where(mask, psi, torch.zeros((), dtype=psi.dtype, device=psi.device)).sum()


def jump_rates(psi: Union[Sequence[float], torch.Tensor]) -> Dict[int, float]:
    """{l: zeta_l for l in 2..L} from the per-layer displacements Psi_1..Psi_L (1-based keys).

    zeta_l is NaN when any of Psi_{l-1}..Psi_L is not finite (``max(0, nan)`` would say
    0): a NaN displacement never reads as "no jump". Finite input: exactly the sum above.
    """
    values = [float(p) for p in (psi.tolist() if isinstance(psi, torch.Tensor) else psi)]
    num_layers = len(values)
    rates: Dict[int, float] = {}
    total = 0.0
    for layer in range(num_layers, 1, -1):  # accumulate from the top: zeta_l = rise_l + zeta_{l+1}
        upper, lower = values[layer - 1], values[layer - 2]
        if math.isfinite(upper) and math.isfinite(lower):
            total += max(0.0, upper - lower)
        else:
            total = math.nan  # and NaN for every zeta below this layer
        rates[layer] = 100.0 * total
    return dict(sorted(rates.items()))


def _softmax_weights(num_layers: int, alpha: float) -> torch.Tensor:
    logits = torch.arange(1, num_layers + 1, dtype=torch.float64) * alpha
    return torch.softmax(logits, dim=0)


def _power_weights(num_layers: int, alpha: float) -> torch.Tensor:
    w = (torch.arange(1, num_layers + 1, dtype=torch.float64) / num_layers) ** alpha
    return w / w.sum()


def _final_weights(num_layers: int, alpha: float) -> torch.Tensor:
    w = torch.zeros(num_layers, dtype=torch.float64)
    w[-1] = 1.0
    return w


# A corrected or new weighting is one entry here.
WEIGHTINGS: Dict[str, Callable[[int, float], torch.Tensor]] = {
    "softmax": _softmax_weights,
    "power": _power_weights,
    "final": _final_weights,
}


def layer_weights(num_layers: int, alpha: float, kind: str = "softmax") -> torch.Tensor:
    """The L layer weights w_1..w_L (fp32, summing to 1) of the given weighting."""
    if num_layers < 1:
        raise ValueError(f"layer_weights: num_layers must be >= 1, got {num_layers}")
    if not math.isfinite(alpha):
        raise ValueError(f"layer_weights: alpha must be finite, got {alpha}")
    if kind not in WEIGHTINGS:
        raise ValueError(
            f"layer_weights: unknown weighting {kind!r}; choose one of {sorted(WEIGHTINGS)}"
        )
    return WEIGHTINGS[kind](num_layers, float(alpha)).to(torch.float32)


def regularizer(psi: Union[Sequence[float], torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    """R = sum_l w_l * Psi_l (differentiable in psi when it is a tensor)."""
    if not isinstance(psi, torch.Tensor):
        psi = torch.tensor([float(p) for p in psi], dtype=torch.float32)
    if psi.shape != weights.shape:
        raise ValueError(f"regularizer: {psi.numel()} displacements for {weights.numel()} weights")
    return (psi * weights.to(psi)).sum()
