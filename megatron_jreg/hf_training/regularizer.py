"""JREG's penalty on any Hugging Face causal LM, through forward hooks on its decoder layers.

:class:`HFJreg` records each layer's input ``h_{l-1}`` and output ``h_l`` (before the final
norm) in every forward and turns them into ``lambda * sum_l w_l(alpha) Psi_l`` over the batch's
real tokens, with its graph, to add to the LM loss. Plain PyTorch loops use it directly;
:mod:`megatron_jreg.hf_training.trainer` wires it into ``transformers.Trainer``. The math is
:mod:`megatron_jreg.jreg` and :mod:`megatron_jreg.ops.displacement`.
"""

from __future__ import annotations

import inspect
import math
from typing import Dict, List, Optional, Tuple

import torch

from megatron_jreg.errors import InputError
from megatron_jreg.hf_training.layers import decoder_layers
from megatron_jreg.jreg import WEIGHTINGS, jump_rates, layer_weights, masked_mean
from megatron_jreg.ops.displacement import IMPLS, token_displacement


def _hidden(output: object) -> torch.Tensor:
    # transformers >= 5 returns the hidden states; earlier versions a tuple starting with them
    return output[0] if isinstance(output, (tuple, list)) else output


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``, or a view of the same memory with the same layout."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"


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
    ``Psi_l`` is the mean of ``psi_l`` over the real tokens (``attention_mask``), as the trainer
    computes it per micro-batch. In a plain PyTorch loop::

        jreg = HFJreg(model, lam=1.0, alpha=1.0)
        for batch in loader:
            out = model(**batch)
            loss, values = jreg.add_penalty(out.loss, batch.get("attention_mask"))
            loss.backward()

    The hooks sit on the layers themselves, so they fire inside any data-parallel wrapper (DDP,
    FSDP, accelerate's), which is reached through its ``.module``. ``generate()`` runs the model
    once per new token: with no training forward before it, the pairs recorded are those of its
    last decode step (one token per row, no graph), and a penalty of them regularizes nothing.
    """

    def __init__(self, model: torch.nn.Module, lam: float = 1.0, alpha: float = 1.0,
                 weighting: str = "softmax", impl: str = "auto"):
        lam, alpha = check_settings(lam, alpha, weighting, impl)
        inner = _unwrapped(model)
        self.path, self.layers = decoder_layers(inner)
        # the module whose forward runs the layers: it receives the 2D mask and marks the
        # start of each forward
        self._decoder = inner.get_submodule(self.path.rpartition(".")[0])
        parameters = list(inspect.signature(self._decoder.forward).parameters)
        self._mask_slot = (parameters.index("attention_mask") if "attention_mask" in parameters
                           else None)  # where a positional attention_mask arrives
        self._flash = "flash" in str(getattr(getattr(inner, "config", None),
                                             "_attn_implementation", "") or "")
        self.num_layers = len(self.layers)
        self.lam, self.impl = lam, impl
        self.weights = layer_weights(self.num_layers, alpha, weighting)
        self._pairs: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._with_graph = False  # the recorded pairs come from a forward with autograd on
        self._fresh = False  # the decoder's forward began and no layer has run yet
        self._skipping = False  # this forward (no_grad, after a graph's) is not recorded
        self._used = False  # the last forward's pairs were taken by penalty()
        self._arrived: Dict[str, object] = {}  # what the decoder's forward was given
        self._inputs: Dict[str, object] = {}  # the same, for the recorded forward
        self._handles = []
        self.attach()

    @property
    def attached(self) -> bool:
        """The hooks are on the model."""
        return bool(self._handles)

    def attach(self) -> None:
        """Put the hooks on the model (after :meth:`remove`; a no-op while they are on)."""
        if self._handles:
            return
        self._handles = [self._decoder.register_forward_pre_hook(self._start, with_kwargs=True)]
        self._handles += [layer.register_forward_hook(self._hook(number), with_kwargs=True)
                          for number, layer in enumerate(self.layers, start=1)]

    def _start(self, module, args, kwargs):
        if torch._C._current_graph_task_id() != -1:
            return None
        mask = kwargs.get("attention_mask")
        if mask is None and self._mask_slot is not None and len(args) > self._mask_slot:
            mask = args[self._mask_slot]
        self._arrived = {"mask": mask.detach() if isinstance(mask, torch.Tensor) else None}
        self._fresh = True
        return None

    def _hook(self, number: int):
        def hook(module, args, kwargs, output):
            if torch._C._current_graph_task_id() != -1:
                # a recompute inside backward (gradient checkpointing): the first pass's pairs
                # keep their graph through the checkpoint
                return
            if self._fresh or number == 1:  # the first layer of a forward
                self._fresh = False
                if not torch.is_grad_enabled() and self._with_graph:
                    self._skipping = True  # a no_grad forward (a logit recompute) keeps the
                    return                 # graph's pairs
                self._skipping = False
                self._pairs.clear()
                self._with_graph = torch.is_grad_enabled()
                self._used = False
                position_ids = kwargs.get("position_ids")
                cache = kwargs.get("cache", kwargs.get("past_key_values"))
                self._inputs = dict(self._arrived, cache=cache is not None, position_ids=(
                    position_ids.detach() if isinstance(position_ids, torch.Tensor) else None))
                self._arrived = {}
            elif self._skipping:
                return
            h_in = args[0] if args else kwargs["hidden_states"]
            self._pairs[number] = (h_in, _hidden(output))
        return hook

    def _stack(self) -> List[Optional[Tuple[torch.Tensor, torch.Tensor]]]:
        """The pairs of layers 1..L; None for a layer that did not run (Mllama's
        cross-attention layers without an image): h_l = h_{l-1}, psi 0. A layer is taken
        for one that did not run only when the next layer that ran received the very tensor
        the previous one returned; otherwise RuntimeError."""
        if not self._pairs:
            if self._used:
                raise RuntimeError("HFJreg.penalty: the recorded layers were already used by the "
                                   "previous penalty() call; run a forward of the model before "
                                   "each penalty() call")
            self._missing()
        numbers = sorted(self._pairs)
        for number in range(1, self.num_layers + 1):
            if number in self._pairs:
                continue
            before = [n for n in numbers if n < number]
            after = [n for n in numbers if n > number]
            if not before or not after or not _same_tensor(
                    self._pairs[after[0]][0], self._pairs[before[-1]][1]):
                self._missing()
        return [self._pairs.get(number) for number in range(1, self.num_layers + 1)]

    def _missing(self) -> None:
        raise RuntimeError(f"HFJreg.penalty: {len(self._pairs)} of {self.num_layers} layers "
                           f"were recorded; call it after a forward of the model whose "
                           f"{self.path} carries the hooks (if another model ran, e.g. "
                           "one made by Trainer(model_init=...), hook that one)")

    def _real_tokens(self, attention_mask: Optional[torch.Tensor],
                     tokens: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """The mask [b, s] of the tokens counted, for hidden states of ``tokens`` = (b, s).
        A mask shorter than the hidden states (PEFT prompt tuning prepends its virtual
        tokens) is the trailing part of the mask the decoder itself received, which counts
        the virtual tokens as real: the model attends to them and every layer moves them."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise InputError("HFJreg.penalty: attention_mask must be a [batch, sequence] tensor "
                             f"(1 = a real token), got {_describe(attention_mask)}")
        if tuple(attention_mask.shape) == tokens:
            return attention_mask.bool()
        own = self._inputs.get("mask")
        if (isinstance(own, torch.Tensor) and tuple(own.shape) == tokens
                and attention_mask.shape[0] == tokens[0]
                and attention_mask.shape[1] < tokens[1]
                and torch.equal(own[:, tokens[1] - attention_mask.shape[1]:].bool(),
                                attention_mask.to(own.device).bool())):
            return own.bool()
        raise InputError(f"HFJreg.penalty: attention_mask has shape {tuple(attention_mask.shape)} "
                         f"but the layers' hidden states have {tokens} tokens and the model's "
                         "own mask does not extend it; give the mask of the batch the forward ran")

    def _check_packing(self, mask: Optional[torch.Tensor]) -> None:
        """Refuse a forward that packed several sequences in a row (position_ids restart)
        where Hugging Face did not keep them apart: it separates them only with no
        attention_mask and no cache (or with a flash-attention kernel), and otherwise lets
        each attend to the ones before it, which Psi would then measure."""
        position_ids = self._inputs.get("position_ids")
        if self._flash or position_ids is None or position_ids.dim() != 2 \
                or position_ids.shape[-1] < 2:
            return
        ids = position_ids
        if mask is not None and tuple(mask.shape) == tuple(ids.shape):
            # only real tokens: left padding's positions (1, 1, 0, 1, ...) are not packing
            ids = ids.to(mask.device)
            packed = any(bool((torch.diff(row[keep]) != 1).any())
                         for row, keep in zip(ids, mask) if int(keep.sum()) > 1)
        else:
            packed = bool((torch.diff(ids, dim=-1) != 1).any())
        if not packed:
            return
        if self._inputs.get("cache"):
            why, fix = "the model kept a cache", "pass use_cache=False to the forward"
        elif self._inputs.get("mask") is not None:
            why, fix = ("the forward was given an attention_mask",
                        "pass position_ids without an attention_mask")
        else:
            return  # Hugging Face separated the sequences
        raise InputError("HFJreg.penalty: the forward packed several sequences in a row "
                         f"(position_ids restart) but {why}, so Hugging Face let them attend "
                         f"to each other and Psi would measure that; {fix}")

    def penalty(self, attention_mask: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """{"penalty": lambda * R (with its graph), "R", "psi" ([L], detached)} of the last
        forward; ``attention_mask`` [b, s] (1 = a real token) picks the tokens counted.
        Clears the recorded pairs: each call needs a forward of its own."""
        stack = self._stack()
        h_last = next(pair for pair in reversed(stack) if pair is not None)[1]
        mask = self._real_tokens(attention_mask, tuple(h_last.shape[:-1]))
        self._check_packing(mask)
        psi = []
        for pair in stack:
            if pair is None:  # a layer that did not run: h_l = h_{l-1}
                psi.append(torch.zeros((), dtype=torch.float32, device=h_last.device))
                continue
            h_prev, h_next = pair
            h_prev = h_prev.to(h_next.device)  # a model spread over devices
            on = None if mask is None else mask.to(h_next.device)
            per_token = token_displacement(h_prev, h_next, impl=self.impl, mask=on)  # [b, s]
            psi.append(masked_mean(per_token, on).float())
        self.clear()
        self._used = True
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
        self._inputs = {}
        self._with_graph = False
        self._used = False

    def remove(self) -> None:
        """Take the hooks off the model and drop what they recorded (:meth:`attach` puts
        them back)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.clear()
        self._arrived = {}
