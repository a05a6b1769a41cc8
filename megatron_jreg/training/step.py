"""One forward/backward over a step's micro-batches through megatron's pipeline schedules."""

from __future__ import annotations

from functools import partial
from typing import Dict, Iterator, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_jreg.model.builder import causal_attention_mask
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.ops.context_chunks import local_part
from megatron_jreg.platform.device import current_device

# A batch is a dict of [b, s] tensors: tokens, labels, loss_mask, position_ids; optionally
# token_mask (bool, True = counted by JREG; default every token).


def _masked_mean_loss(per_token_scale: Optional[float], loss_mask: torch.Tensor,
                      count: torch.Tensor, output_tensor: torch.Tensor):
    """LM loss of one micro-batch; output_tensor: [b, s_local] token cross-entropies of this
    rank's part of the sequence, ``loss_mask`` its part of the mask, ``count`` the
    loss-masked tokens of the whole micro-batch.

    Default: the mean over the micro-batch's loss-masked tokens. Under context parallelism
    it is this rank's share: its masked sum over the whole micro-batch's count. The shares
    add up over the CP group to the mean over the whole sequence, as on one rank, whatever
    the mask (megatron's schedule scales each share by the CP size and the gradient
    reduction averages over DP x CP). With ``per_token_scale`` (micro-batches x DP ranks /
    loss-masked tokens of the global batch): the masked sum times it, so that megatron's
    mean over micro-batches and DDP's mean over DP ranks give the mean over every
    loss-masked token of the global batch."""
    total = (output_tensor.float() * loss_mask.float()).sum()
    loss = total / count if per_token_scale is None else total * per_token_scale
    return loss, {"lm loss": loss.clone().detach()}


def global_loss_tokens(batches: List[Dict[str, torch.Tensor]]) -> float:
    """Loss-masked tokens in the global batch: this DP rank's micro-batches, summed over DP."""
    count = torch.zeros(1, dtype=torch.float64, device=batches[0]["loss_mask"].device)
    for batch in batches:
        count += batch["loss_mask"].double().sum()
    torch.distributed.all_reduce(count, group=parallel_state.get_data_parallel_group())
    return float(count.item())


def _forward_step(tracker: Optional[JregTracker], per_token_scale: Optional[float],
                  data_iterator, model):
    batch = next(data_iterator)
    if tracker is not None:
        tracker.set_token_mask(batch.get("token_mask"))  # the whole sequence's: it splits it
    count = batch["loss_mask"].float().sum().clamp(min=1.0)
    cp_size = parallel_state.get_context_parallel_world_size()
    cp_rank = parallel_state.get_context_parallel_rank()
    tokens, labels, loss_mask, positions = (
        local_part(batch[key], 1, cp_size, cp_rank)
        for key in ("tokens", "labels", "loss_mask", "position_ids"))
    # the whole sequence's causal mask: each attention takes its rank's part of it
    attention_mask = causal_attention_mask(batch["tokens"].shape[1], device=tokens.device)
    output = model(tokens, positions, attention_mask, labels=labels)
    return output, partial(_masked_mean_loss, per_token_scale, loss_mask, count)


def forward_backward(
    model: List[torch.nn.Module],
    batches: List[Dict[str, torch.Tensor]],
    seq_length: int,
    micro_batch_size: int,
    tracker: Optional[JregTracker],
    forward_only: bool = False,
    per_token_loss: bool = False,
    count_loss_tokens: bool = True,
    reduce_metrics: bool = True,
) -> Dict[str, object]:
    """Run one step's micro-batches (forward, and backward unless ``forward_only``).

    ``batches`` are this data-parallel rank's micro-batches; every pipeline stage gets the
    same list (the first stage reads tokens, the last labels), holding whole sequences:
    each context-parallel rank takes its chunks of them. Returns the LM loss averaged
    over micro-batches (on the last stage; None elsewhere) and the JREG metrics reduced
    over TP/PP/DP (every rank). Gradients accumulate in the model's grad buffers.
    ``per_token_loss``: the LM loss is the mean over the global batch's loss-masked tokens
    (``--calculate-per-token-loss``), not the mean of the micro-batches' means.

    A global batch without a loss token (SFT samples whose replies are all cut) has no LM
    loss: a mean over it is 0/0. Nothing runs and every rank (they share the count) gets
    ``no_loss_tokens`` True and None for the loss and the JREG metrics; the caller skips it.
    ``count_loss_tokens`` False (data whose every sample has loss tokens, without
    ``per_token_loss``) skips that count and its wait for the device.

    ``reduce_metrics`` False: nothing waits for the device or communicates after the
    schedule; ``lm_loss`` is then this rank's 0-dim float64 tensor (zeros off the last
    stage) and ``jreg_stats`` the tracker's :meth:`JregTracker.local_stats`, for the caller
    to reduce with other steps' (``jreg_layer.reduce_stats``).
    """
    num_microbatches = len(batches)
    loss_tokens = global_loss_tokens(batches) if count_loss_tokens or per_token_loss else None
    if loss_tokens == 0:
        return {"lm_loss": None, "no_loss_tokens": True, "penalty": None, "R": None, "psi": None}
    per_token_scale = None
    if per_token_loss:
        dp = parallel_state.get_data_parallel_world_size()
        per_token_scale = num_microbatches * dp / loss_tokens
    config = model[0].config
    if tracker is not None:
        tracker.reset()
        scale = 1.0
        if config.grad_scale_func is not None and not forward_only:
            device = next(model[0].parameters()).device
            # the optimizer's loss scale where it lives: the penalty's backward reads it there
            scale = config.grad_scale_func(torch.ones(1, device=device))
        tracker.set_loss_scale(scale, num_microbatches)
    # one iterator per model chunk: each chunk reads every micro-batch once
    iterators: List[Iterator] = [iter(batches) for _ in model]
    losses = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, tracker, per_token_scale),
        data_iterator=iterators if len(model) > 1 else iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    lm_loss = None
    if losses:
        lm_loss = torch.stack([x["lm loss"] for x in losses]).mean().double()
    if not reduce_metrics:  # each CP rank's share: the window adds them
        if lm_loss is None:
            lm_loss = torch.zeros((), dtype=torch.float64, device=current_device())
        return {"lm_loss": lm_loss, "no_loss_tokens": False,
                "jreg_stats": tracker.local_stats() if tracker is not None else None}
    if lm_loss is not None and parallel_state.get_context_parallel_world_size() > 1:
        # the CP ranks (all on this stage) hold shares of the same micro-batches' losses
        torch.distributed.all_reduce(lm_loss, group=parallel_state.get_context_parallel_group())
    result: Dict[str, object] = {"lm_loss": None if lm_loss is None else float(lm_loss),
                                 "no_loss_tokens": False}
    if tracker is not None:
        result.update(tracker.reduce())
    return result
