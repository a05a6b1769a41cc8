"""One forward/backward over a step's micro-batches through megatron's pipeline schedules."""

from __future__ import annotations

from functools import partial
from typing import Dict, Iterator, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_jreg.model.builder import causal_attention_mask
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.platform.device import current_device

# A batch is a dict of [b, s] tensors: tokens, labels, loss_mask, position_ids; optionally
# token_mask (bool, True = counted by JREG; default every token).


def _masked_mean_loss(per_token_scale: Optional[float], loss_mask: torch.Tensor,
                      output_tensor: torch.Tensor):
    """LM loss of one micro-batch; output_tensor: [b, s] token cross-entropies.

    Default: the mean over the micro-batch's loss-masked tokens. With ``per_token_scale``
    (micro-batches x DP ranks / loss-masked tokens of the global batch): the masked sum
    times it, so that megatron's mean over micro-batches and DDP's mean over DP ranks give
    the mean over every loss-masked token of the global batch."""
    losses = output_tensor.float()
    mask = loss_mask.float()
    if per_token_scale is None:
        loss = (losses * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        loss = (losses * mask).sum() * per_token_scale
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
    tokens = batch["tokens"]
    if tracker is not None:
        tracker.set_token_mask(batch.get("token_mask"))
    attention_mask = causal_attention_mask(tokens.shape[1], device=tokens.device)
    output = model(tokens, batch["position_ids"], attention_mask, labels=batch["labels"])
    return output, partial(_masked_mean_loss, per_token_scale, batch["loss_mask"])


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
    same list (the first stage reads tokens, the last labels). Returns the LM loss averaged
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
    if not reduce_metrics:
        if lm_loss is None:
            lm_loss = torch.zeros((), dtype=torch.float64, device=current_device())
        return {"lm_loss": lm_loss, "no_loss_tokens": False,
                "jreg_stats": tracker.local_stats() if tracker is not None else None}
    result: Dict[str, object] = {"lm_loss": None if lm_loss is None else float(lm_loss),
                                 "no_loss_tokens": False}
    if tracker is not None:
        result.update(tracker.reduce())
    return result
