"""The values of a window of training steps, read from the device once when it is logged."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_jreg.model.jreg_layer import JregTracker, psi_means, reduce_stats


def reduce_window(window: List[Dict], tracker: JregTracker, dp_size: int) -> None:
    """Fill in the LM loss (the last stage's, added over its CP ranks' shares and averaged
    over DP) and Psi, R and penalty of
    each step of ``window`` left on the device by ``Trainer.train_step``: one all-reduce per
    group and one wait for the whole window. Collective."""
    steps = [w for w in window if not w["no_loss_tokens"] and w.get("jreg_stats") is not None]
    if not steps:
        return
    losses = torch.stack([w.pop("lm_loss") for w in steps])  # [n] float64
    dist.all_reduce(losses, group=parallel_state.get_pipeline_model_parallel_group())
    dist.all_reduce(losses,
                    group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    psi = psi_means(reduce_stats(torch.stack([w.pop("jreg_stats") for w in steps])))
    for w, loss, values in zip(steps, (losses / dp_size).tolist(), psi.tolist()):
        w.update(tracker.values(values), lm_loss=loss)
