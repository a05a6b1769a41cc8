"""The JREG math as pure functions: displacement, jump rates, layer weights.

Shibata et al., "Suppressing Final Layer Hidden State Jumps in Transformer Pretraining":
psi_l = (1 - cos(h_{l-1}, h_l)) / 2 per token, Psi_l its masked mean, w_l(alpha) the layer
weights, R = sum_l w_l Psi_l and the jump rate zeta_l (docs/design.md, "The math"). The
per-token psi is ``megatron_jreg.ops.displacement``; the training layer
(``megatron_jreg.model.jreg_layer``) calls these functions. Imports neither megatron,
torch.distributed nor ``megatron_jreg.ops``: anyone can read and test it.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch

# Floor on |a| * |b| in the cosine; a zero vector gives cos = 0 (psi = 0.5), never NaN.
EPS = 1e-8


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


def masked_mean(psi: torch.Tensor, mask: Optional[torch.Tensor] = None,
                count: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
    """Psi: the sum of per-token ``psi`` over the counted tokens, divided by ``count``.

    ``count`` defaults to the number of tokens ``mask`` counts (every token when None); it
    is given where this process holds a slice of the tokens (sequence parallelism) and the
    mean is over all of them: the result is then this slice's share of Psi.
    """
    if count is None:
        if mask is None:
            return psi.mean()
        count = int(mask.sum())
        if count == 0:
            raise ValueError("displacement: the mask counts no tokens; at least one must be True")
    return masked_sum(psi, mask) / count


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


def _stable_softmax(rates: torch.Tensor, alpha: float) -> torch.Tensor:
    """softmax(alpha * rates) computed as softmax(alpha * (rates - ref)), ref the entry the
    sign of alpha makes largest: every logit is <= 0, so no finite alpha overflows to NaN
    (1e308 * l would be inf, and inf - inf is NaN); huge |alpha| gives the one-hot limit."""
    ref = rates.max() if alpha >= 0 else rates.min()
    logits = (rates - ref) * alpha
    return torch.softmax(logits, dim=0)


def _softmax_weights(num_layers: int, alpha: float) -> torch.Tensor:
    return _stable_softmax(torch.arange(1, num_layers + 1, dtype=torch.float64), alpha)


def _power_weights(num_layers: int, alpha: float) -> torch.Tensor:
    # (l/L)^alpha / sum = softmax(alpha * log l): the same weights without overflow
    return _stable_softmax(torch.log(torch.arange(1, num_layers + 1, dtype=torch.float64)), alpha)


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


def regularizer(psi: Union[Sequence[float], torch.Tensor],
                weights: Union[Sequence[float], torch.Tensor]) -> Union[torch.Tensor, float]:
    """R = sum_l w_l * Psi_l.

    A tensor ``psi`` gives a tensor, differentiable in psi. A sequence of floats (measured
    values, as logged) gives a float, summed layer by layer in double precision.
    """
    if isinstance(psi, torch.Tensor):
        weights = torch.as_tensor(weights)
        if psi.shape != weights.shape:
            raise ValueError(
                f"regularizer: {psi.numel()} displacements for {weights.numel()} weights")
        return (psi * weights.to(psi)).sum()
    values = [float(p) for p in psi]
    w: List[float] = (weights.tolist() if isinstance(weights, torch.Tensor)
                      else [float(x) for x in weights])
    if len(values) != len(w):
        raise ValueError(f"regularizer: {len(values)} displacements for {len(w)} weights")
    return float(sum(w_l * p for w_l, p in zip(w, values)))
