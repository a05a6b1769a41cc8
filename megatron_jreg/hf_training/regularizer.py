"""JREG's penalty on any Hugging Face causal LM: forward hooks on its decoder layers.

Layer ``l``'s input is ``h_{l-1}`` and its output ``h_l`` (before the final norm); each
forward of the model records the pairs, and :meth:`HFJreg.penalty` turns them into
``lambda * sum_l w_l(alpha) Psi_l`` with ``Psi_l`` the mean of ``psi_l`` over the batch's
real tokens (``attention_mask``), as the trainer computes it per micro-batch. The penalty
keeps its graph: add it to the LM loss before ``backward``.

In a plain PyTorch loop::

    jreg = HFJreg(model, lam=1.0, alpha=1.0)
    for batch in loader:
        out = model(**batch)
        loss, values = jreg.add_penalty(out.loss, batch.get("attention_mask"))
        loss.backward()

A model wrapped for data parallelism (DDP, FSDP, accelerate's wrapper) is reached through
its ``.module``; the hooks sit on the layers themselves, so they fire inside any wrapper.

A forward under ``no_grad`` after a training forward (a trainer recomputing logits for a
metric) does not replace the training forward's pairs; the next forward with autograd on
does.

Gradient checkpointing runs a layer's forward again during backward: that second pass is
not recorded (the pairs of the first keep their graph through the checkpoint).

``generate()`` runs the model once per new token: with no training forward before it, the
pairs recorded are those of its last decode step (one token per row, no graph), so
:meth:`HFJreg.penalty` then measures that step and its penalty regularizes nothing.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

import math

from megatron_jreg.errors import InputError
from megatron_jreg.hf_training.layers import decoder_layers
from megatron_jreg.jreg import WEIGHTINGS, jump_rates, layer_weights, masked_mean
from megatron_jreg.ops.displacement import IMPLS, token_displacement


def _hidden(output: object) -> torch.Tensor:
    # transformers >= 5 returns the hidden states; earlier versions a tuple starting with them
    return output[0] if isinstance(output, (tuple, list)) else output


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside data-parallel wrappers (they hold it as ``.module`` and carry no
    config of their own)."""
    while getattr(model, "config", None) is None and isinstance(
            getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _number(value, owner: str, name: str, nonnegative: bool) -> float:
    """``value`` as a float, or InputError naming ``owner``'s argument and its rule."""
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several values
        number = None
    if number is None or not math.isfinite(number) or (nonnegative and number < 0):
        rule = "a finite number >= 0" if nonnegative else "a finite number"
        raise InputError(f"{owner}: {name} must be {rule}, got {value!r}")
    return number


def check_settings(lam, alpha, weighting: str, impl: str, owner: str = "HFJreg",
                   names=("lam", "alpha", "weighting", "impl")) -> Tuple[float, float]:
    """(lam, alpha) as floats, after the trainer's rules (--jreg-lambda a finite number >= 0,
    --jreg-alpha finite, a known weighting and impl); InputError naming ``owner``'s argument
    (``names``) otherwise. A NaN or infinite lambda would make every loss NaN or infinite, a
    negative one reward the jump JREG suppresses."""
    lam = _number(lam, owner, names[0], nonnegative=True)
    alpha = _number(alpha, owner, names[1], nonnegative=False)
    if not isinstance(weighting, str) or weighting not in WEIGHTINGS:
        raise InputError(f"{owner}: {names[2]} must be one of {sorted(WEIGHTINGS)}, "
                         f"got {weighting!r}")
    if not isinstance(impl, str) or impl not in IMPLS:
        raise InputError(f"{owner}: {names[3]} must be one of {list(IMPLS)}, got {impl!r}")
    return lam, alpha


class HFJreg:
    """The JREG penalty of ``model`` (a transformers causal LM, or a PEFT wrapper of one).

    ``lam``, ``alpha``, ``weighting``: the trainer's --jreg-lambda, --jreg-alpha and
    --jreg-weighting; ``impl``: the displacement op's implementation (auto, fused, torch).
    """

    def __init__(self, model: torch.nn.Module, lam: float = 1.0, alpha: float = 1.0,
                 weighting: str = "softmax", impl: str = "auto"):
        lam, alpha = check_settings(lam, alpha, weighting, impl)
        self.path, self.layers = decoder_layers(_unwrapped(model))
        self.num_layers = len(self.layers)
        self.lam, self.impl = lam, impl
        self.weights = layer_weights(self.num_layers, alpha, weighting)
        self._pairs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._with_graph = False  # the recorded pairs come from a forward with autograd on
        self._handles = [layer.register_forward_hook(self._hook(number), with_kwargs=True)
                         for number, layer in enumerate(self.layers, start=1)]

    def _hook(self, number: int):
        def hook(module, args, kwargs, output):
            if torch._C._current_graph_task_id() != -1:
                return  # a recompute inside backward (gradient checkpointing)
            if not torch.is_grad_enabled() and self._with_graph:
                return  # a forward under no_grad (a logit recompute) keeps the graph's pairs
            if number == 1:
                self._with_graph = torch.is_grad_enabled()
            h_in = args[0] if args else kwargs["hidden_states"]
            self._pairs[number] = (h_in, _hidden(output))
        return hook

    def penalty(self, attention_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """{"penalty": lambda * R (with its graph), "R", "psi" ([L], detached)} of the last
        forward; ``attention_mask`` [b, s] (1 = a real token) picks the tokens counted.
        Clears the recorded pairs."""
        if len(self._pairs) != self.num_layers:
            raise RuntimeError(f"HFJreg.penalty: {len(self._pairs)} of {self.num_layers} layers "
                               f"were recorded; call it after a forward of the model whose "
                               f"{self.path} carries the hooks (if another model ran, e.g. "
                               "one made by Trainer(model_init=...), hook that one)")
        psi = []
        for number in range(1, self.num_layers + 1):
            h_prev, h_next = self._pairs[number]
            h_prev = h_prev.to(h_next.device)  # a model spread over devices
            mask = None if attention_mask is None else attention_mask.to(h_next.device).bool()
            per_token = token_displacement(h_prev, h_next, impl=self.impl, mask=mask)  # [b, s]
            psi.append(masked_mean(per_token, mask).float())
        self.clear()
        device = psi[-1].device
        psi_all = torch.stack([p.to(device) for p in psi])  # [L] fp32
        r = (self.weights.to(device=device, dtype=psi_all.dtype) * psi_all).sum()
        return {"penalty": self.lam * r, "R": r.detach(), "psi": psi_all.detach()}

    def add_penalty(self, loss: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        """(``loss`` + the penalty of the last forward, :meth:`penalty`'s values): the loss
        to call ``backward`` on in a plain loop."""
        values = self.penalty(attention_mask)
        return loss + values["penalty"].to(loss.dtype), values

    def rates(self, psi: torch.Tensor) -> Dict[str, float]:
        """zeta_L, zeta_{L-1}, zeta_{L-2} of ``psi`` (per-layer displacement)."""
        rates = jump_rates(psi.tolist())
        L = self.num_layers
        return {"zeta_L": rates.get(L, 0.0), "zeta_L-1": rates.get(L - 1, 0.0),
                "zeta_L-2": rates.get(L - 2, 0.0)}

    def clear(self) -> None:
        """Drop the recorded pairs (a forward whose penalty is not wanted, e.g. evaluation)."""
        self._pairs.clear()
        self._with_graph = False

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()
