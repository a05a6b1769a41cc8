"""JREG inside megatron-core: a TransformerLayer that measures and penalises its displacement.

Each layer computes Psi_l on the rank and pipeline stage where it runs and attaches
lambda * w_l * Psi_l to its output with ``ops.attach_penalty`` (identity forward; backward
injects the penalty's gradient), as megatron-core carries MoE auxiliary losses. The math is
``megatron_jreg.jreg``'s; the logged values are an ``ops.psi_accumulator.PsiAccumulator``.
``model.builder`` puts the layer into the spec.
"""

from __future__ import annotations

import copy
from collections import defaultdict, deque
from typing import Deque, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as tp_random
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_jreg.config.model import JregConfig
from megatron_jreg.jreg import layer_weights, masked_mean, regularizer
from megatron_jreg.ops import attach_penalty, token_displacement
from megatron_jreg.ops.psi_accumulator import PsiAccumulator, local_token_mask, owns_tokens
from megatron_jreg.platform.device import current_device


class JregTracker:
    """Per-process JREG state shared by the model's layers.

    Holds the config and layer weights, the backward scale of the penalty, and a
    :class:`PsiAccumulator` of each layer's Psi_l over the micro-batches of one step (or one
    evaluation), counted in micro-batches. It lives on the activations' device and is
    reduced only by :meth:`reduce`.
    """

    def __init__(self, config: JregConfig, num_layers: int, sequence_parallel: bool = False):
        self.config = config
        self.num_layers = num_layers
        self.sequence_parallel = sequence_parallel
        self.weights = layer_weights(num_layers, config.alpha, config.weighting)
        self._weights_list = self.weights.tolist()
        self.loss_scale = 1.0
        self.token_mask: Optional[torch.Tensor] = None  # [b, s] bool of the current micro-batch
        # sum over micro-batches of this rank's share of Psi_l, fp32 as the partials are
        self._psi = PsiAccumulator(num_layers, dtype=torch.float32)
        self._microbatches = [0] * num_layers  # micro-batches seen per layer on this rank
        # Full recompute replays a layer in backward, after later micro-batches' forwards
        # have replaced token_mask. Each layer's no-grad pass queues its mask here and the
        # recompute takes it back: megatron's schedules run a chunk's backwards in the order
        # of its forwards, so a FIFO per layer pairs them.
        self._recompute_masks: Dict[int, Deque[tuple]] = defaultdict(deque)

    # ---- per step -------------------------------------------------------------------------
    def set_loss_scale(self, loss_scale, num_microbatches: int) -> None:
        """The main loss's backward scale (a number, or a 0-dim tensor on the device: the
        step then never waits for it) over the micro-batches. Under context parallelism
        megatron's schedule scales each CP rank's loss by the CP size (the gradient
        reduction averages over DP x CP): the penalty's share is scaled alike."""
        cp = _context_parallel()[0]
        if isinstance(loss_scale, torch.Tensor):
            self.loss_scale = loss_scale.detach().reshape(()) * cp / num_microbatches
        else:
            self.loss_scale = float(loss_scale) * cp / num_microbatches

    def set_token_mask(self, mask: Optional[torch.Tensor]) -> None:
        """[b, s] bool, True = counted, for the next forward; None counts every token."""
        self.token_mask = mask

    def reset(self) -> None:
        self._psi.reset()
        self._microbatches = [0] * self.num_layers
        self._recompute_masks.clear()

    # ---- called by each layer -------------------------------------------------------------
    def _local_mask(self, hidden: torch.Tensor):
        """(mask as [s_local, b] for this rank's slice of the sequence or None, the number of
        tokens counted in the whole micro-batch, all TP and CP ranks' slices included).

        hidden: this rank's [s_local, b, h] hidden states."""
        tokens_shape = tuple(hidden.shape[:-1])
        cp_size, cp_rank = _context_parallel()
        if self.token_mask is None:
            tokens = hidden[..., 0].numel() * cp_size
            if self.sequence_parallel:
                tokens *= parallel_state.get_tensor_model_parallel_world_size()
            return None, float(tokens)
        # the full-sequence mask is known on every TP and CP rank: no communication needed
        count = self.token_mask.sum().to(device=hidden.device, dtype=torch.float32).clamp(min=1.0)
        mask = local_token_mask(self.token_mask, self.sequence_parallel,
                                parallel_state.get_tensor_model_parallel_rank(),
                                parallel_state.get_tensor_model_parallel_world_size(),
                                cp_size, cp_rank)
        if tuple(mask.shape) != tokens_shape:
            raise ValueError(
                f"JREG token mask {tuple(mask.shape)} does not match the layer's tokens "
                f"{tokens_shape} ([s, b]); set_token_mask takes [b, s] of the whole sequence")
        return mask.to(device=hidden.device), count

    def observe(self, layer_number: int, h_prev: torch.Tensor,
                h_next: torch.Tensor) -> torch.Tensor:
        """Measure layer ``layer_number`` (global, 1-based) and attach its penalty.

        Returns ``h_next``, carrying the penalty's gradient when grad is enabled.
        """
        grad = torch.is_grad_enabled()
        checkpointing = tp_random.is_checkpointing()
        # Full recompute runs each layer twice: once without grad (record here), once in
        # backward with grad (attach here). Record once, attach only where grad flows.
        record = not (grad and checkpointing)
        attach = grad and self.config.lam > 0.0
        if not (record or attach):
            return h_next
        with torch.set_grad_enabled(attach):
            if checkpointing and grad:  # the recompute: the mask of its own micro-batch
                mask, count = self._recompute_masks[layer_number].popleft()
            else:
                mask, count = self._local_mask(h_next)
                if checkpointing and self.config.lam > 0.0:
                    self._recompute_masks[layer_number].append((mask, count))
            # [s_local, b] fp32; masked-out tokens give 0 and zero gradient (NaN included)
            psi = token_displacement(h_prev, h_next, impl=self.config.impl, mask=mask)
            partial = masked_mean(psi, mask, count)  # this rank's share of Psi_l
        if record:
            self._record(layer_number, partial.detach())
        if attach:
            penalty = partial * (self.config.lam * self._weights_list[layer_number - 1])
            # A custom Function returning its input gives a view; a stage's output must be
            # viewless for the schedule's deallocate_output_tensor (deallocate_pipeline_outputs).
            h_next = make_viewless_tensor(attach_penalty(h_next, penalty, self.loss_scale),
                                          requires_grad=True, keep_graph=True)
        return h_next

    def _record(self, layer_number: int, partial: torch.Tensor) -> None:
        # counted once over TP: this rank's share of Psi_l when the tokens are its own; the
        # micro-batch itself, held by every TP and CP rank, by TP rank 0 of CP rank 0. Each
        # CP rank's tokens are its own.
        tp_rank = (parallel_state.get_tensor_model_parallel_rank()
                   if parallel_state.model_parallel_is_initialized() else 0)
        if owns_tokens(self.sequence_parallel, tp_rank):
            first = tp_rank == 0 and _context_parallel()[1] == 0
            self._psi.add_sums(layer_number, partial, 1.0 if first else 0.0)
        self._microbatches[layer_number - 1] += 1

    # ---- per step, collective -----------------------------------------------------------
    def reduce(self) -> Dict[str, object]:
        """Psi_1..Psi_L (global layer numbers) averaged over micro-batches and DP ranks.

        Collective over the TP, PP and DP-with-CP groups: every rank calls it. Returns {"psi": [L
        floats], "R": float, "penalty": float, "microbatches": [this rank's micro-batch
        count per layer, 0 for layers on other stages]}.
        """
        values = self.values(psi_means(reduce_stats(self.local_stats())).tolist())
        values["microbatches"] = list(self._microbatches)
        return values

    def local_stats(self) -> torch.Tensor:
        """[2, L] this rank's sums of Psi_l and their counts (a copy, on the run's device; zeros
        where no layer of this step ran here): what :func:`reduce_stats` adds over ranks. Read
        without waiting for the device, so a trainer can reduce many steps at once."""
        return self._psi.reduce([], device=current_device())._stats

    def values(self, psi: List[float]) -> Dict[str, object]:
        """{"psi", "R", "penalty"} of one step's Psi_1..Psi_L (:func:`psi_means`)."""
        r = regularizer(psi, self._weights_list)
        return {"psi": psi, "R": r, "penalty": self.config.lam * r}


def psi_means(stats: torch.Tensor) -> torch.Tensor:
    """[..., L] Psi_l of reduced stats [..., 2, L] (sums over counts; a layer counted nowhere
    gives 0), on the device."""
    return stats[..., 0, :] / stats[..., 1, :].clamp(min=1.0)


def reduce_stats(stats: torch.Tensor) -> torch.Tensor:
    """:meth:`JregTracker.local_stats` (of one step, [2, L], or of several, [n, 2, L]) added
    over the TP, PP and DP ranks (with the CP ranks, which hold the same batch's other
    chunks): one all-reduce per group, whatever the number of steps. Collective: every rank
    calls it."""
    if (dist.is_available() and dist.is_initialized()
            and parallel_state.model_parallel_is_initialized()):
        for group in (parallel_state.get_tensor_model_parallel_group(),
                      parallel_state.get_pipeline_model_parallel_group(),
                      parallel_state.get_data_parallel_group(with_context_parallel=True)):
            dist.all_reduce(stats, group=group)
    return stats


def _context_parallel() -> tuple:
    """(CP size, CP rank) of this process; (1, 0) outside megatron's groups."""
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return (parallel_state.get_context_parallel_world_size(),
            parallel_state.get_context_parallel_rank())


class JregTransformerLayer(TransformerLayer):
    """megatron-core's TransformerLayer, reporting (input, output) to a :class:`JregTracker`.

    Swapped in through the layer spec (``ModuleSpec(module=JregTransformerLayer,
    params={"jreg_tracker": tracker})``); all of the layer's own computation is megatron's.
    """

    def __init__(self, config, *args, jreg_tracker: Optional[JregTracker] = None,
                 gradient_accumulation_fusion: Optional[bool] = None, **kwargs):
        if (gradient_accumulation_fusion is not None
                and gradient_accumulation_fusion != config.gradient_accumulation_fusion):
            # Transformer Engine's linears fuse the weight-gradient accumulation themselves,
            # while the model's output layer (megatron-core's own linear, built from the
            # model's config) needs apex for it: this layer is built from a copy holding its
            # own setting, as megatron-core builds heterogeneous layers from per-layer configs
            config = copy.copy(config)
            config.gradient_accumulation_fusion = gradient_accumulation_fusion
        super().__init__(config, *args, **kwargs)
        self.jreg_tracker = jreg_tracker

    def forward(self, *args, **kwargs):
        # [s, b, h]
        hidden_states = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        output, context = super().forward(*args, **kwargs)
        if self.jreg_tracker is not None:
            output = self.jreg_tracker.observe(self.layer_number, hidden_states, output)
        return output, context
