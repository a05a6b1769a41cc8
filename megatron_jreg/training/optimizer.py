"""The optimizer side of a step: megatron's optimizer and LR/WD schedule, and an update
that a non-finite gradient norm skips under every precision."""

from __future__ import annotations

import math
from typing import List, Tuple

from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler


def build_optimizer(model, config, model_cfg, o):
    """AdamW over the DDP-wrapped ``model`` chunks (``o``: the optim section)."""
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=model_cfg.bf16, fp16=model_cfg.fp16,
        params_dtype=config.params_dtype, initial_loss_scale=o.initial_loss_scale,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    return get_megatron_optimizer(opt_config, model)


def build_scheduler(optimizer, o, train_cfg) -> OptimizerParamScheduler:
    """megatron's OptimizerParamScheduler in its sample units, with Megatron-LM's lengths
    (``OptimConfig.schedule_samples``: iterations x global batch, or samples as given)."""
    g = train_cfg.global_batch_size
    train_samples = train_cfg.train_samples or train_cfg.train_iters * g
    lengths = o.schedule_samples(train_samples, g)
    wsd = o.lr_decay_style == "WSD"
    return OptimizerParamScheduler(
        optimizer, init_lr=o.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=lengths["warmup"], lr_decay_steps=lengths["decay"],
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=train_samples, wd_incr_style="constant",
        wsd_decay_steps=lengths["wsd"] if wsd else None,
        lr_wsd_decay_style=o.lr_wsd_decay_style if wsd else None,
    )


def optimizer_step(opt) -> Tuple[bool, float, List[str]]:
    """megatron's optimizer.step() in its parts, so that a non-finite gradient norm skips
    the update under bf16/fp32 too (megatron checks only fp16's loss-scaler overflow).
    Returns (updated, grad norm, [why a non-finite step was skipped])."""
    if opt.prepare_grads():  # fp16: the loss scaler saw inf/NaN and lowered its scale
        return False, float("nan"), []
    grad_norm = float(opt.get_grad_norm())
    if not math.isfinite(grad_norm):
        return False, grad_norm, [f"gradient norm is {grad_norm}"]
    for part in getattr(opt, "chained_optimizers", [opt]):
        params = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
        if params and part.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(
                params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return opt.step_with_ready_grads(), grad_norm, []
