"""Trainer configuration: optimizer, schedule, batches, data, checkpoints, logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from megatron_jreg.model.config import JregConfig, ModelConfig, ParallelConfig, _flag


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW through megatron-core's get_megatron_optimizer, and the LR/WD schedule."""

    lr: float = field(default=3e-4, metadata=_flag("--lr", "peak learning rate"))
    min_lr: float = field(default=0.0, metadata=_flag("--min-lr", "final learning rate"))
    lr_warmup_iters: int = field(default=0, metadata=_flag("--lr-warmup-iters", "linear warmup steps"))
    lr_decay_iters: Optional[int] = field(default=None, metadata=_flag(
        "--lr-decay-iters", "steps of decay; default --train-iters"))
    lr_decay_style: str = field(default="cosine", metadata=_flag(
        "--lr-decay-style", "cosine, linear, constant or WSD"))
    lr_wsd_decay_iters: Optional[int] = field(default=None, metadata=_flag(
        "--lr-wsd-decay-iters", "WSD: steps of the final decay; default 10% of decay"))
    lr_wsd_decay_style: str = field(default="linear", metadata=_flag(
        "--lr-wsd-decay-style", "WSD: exponential, linear, cosine or minus_sqrt"))
    weight_decay: float = field(default=0.1, metadata=_flag("--weight-decay", "AdamW weight decay"))
    adam_beta1: float = field(default=0.9, metadata=_flag("--adam-beta1", "Adam beta1"))
    adam_beta2: float = field(default=0.95, metadata=_flag("--adam-beta2", "Adam beta2"))
    adam_eps: float = field(default=1e-8, metadata=_flag("--adam-eps", "Adam epsilon"))
    clip_grad: float = field(default=1.0, metadata=_flag("--clip-grad", "global grad-norm clip (0 = off)"))
    use_distributed_optimizer: bool = field(default=False, metadata=_flag(
        "--use-distributed-optimizer", "shard optimizer state over data-parallel ranks"))
    initial_loss_scale: float = field(default=2.0**16, metadata=_flag(
        "--initial-loss-scale", "fp16: initial dynamic loss scale"))
    override_opt_param_scheduler: bool = field(default=False, metadata=_flag(
        "--override-opt-param-scheduler",
        "on --load, use the schedule flags (--lr, --min-lr, warmup, decay) over the checkpoint's",
        aliases=["--override-opt_param-scheduler"]))
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata=_flag(
        "--use-checkpoint-opt-param-scheduler",
        "on --load, keep the checkpoint's schedule whatever the flags say (neither flag: a "
        "difference is an error)", aliases=["--use-checkpoint-opt_param-scheduler"]))

    def __post_init__(self):
        if self.lr_decay_style not in ("cosine", "linear", "constant", "WSD", "inverse-square-root"):
            raise ValueError(
                f"--lr-decay-style {self.lr_decay_style!r}: choose cosine, linear, constant or WSD")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        if self.lr_warmup_iters < 0:
            raise ValueError("--lr-warmup-iters must be >= 0")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler "
                             "contradict each other; pass one")

    def scheduler_mode(self) -> str:
        """How a resumed schedule is reconciled with the flags (checkpoint.dist_checkpoint.load_scheduler)."""
        if self.override_opt_param_scheduler:
            return "override"
        return "checkpoint" if self.use_checkpoint_opt_param_scheduler else "strict"


@dataclass(kw_only=True)
class TrainingConfig:
    """Batches, steps, evaluation and run control."""

    micro_batch_size: int = field(default=4, metadata=_flag("--micro-batch-size", "sequences per micro-batch"))
    global_batch_size: int = field(default=16, metadata=_flag(
        "--global-batch-size", "sequences per step over all data-parallel ranks"))
    train_iters: int = field(default=100, metadata=_flag("--train-iters", "optimizer steps"))
    eval_interval: int = field(default=50, metadata=_flag(
        "--eval-interval", "steps between validation runs (0 = never)"))
    eval_iters: int = field(default=4, metadata=_flag("--eval-iters", "validation batches per run"))
    seed: int = field(default=1234, metadata=_flag("--seed", "seed of init, data order and dropout"))
    exit_signal_handler: bool = field(default=True, metadata=_flag(
        "--exit-signal-handler", "on SIGTERM/SIGINT save a checkpoint and exit cleanly"))
    exit_on_nan: bool = field(default=True, metadata=_flag(
        "--exit-on-nan", "stop with exit code 3, before any save, at a step whose loss, JREG "
        "penalty or gradient norm is NaN/inf (--no-exit-on-nan skips such steps: no update)"))
    exit_interval: Optional[int] = field(default=None, metadata=_flag(
        "--exit-interval", "save and exit after this many steps (for tests and preemption drills)"))
    calculate_per_token_loss: bool = field(default=False, metadata=_flag(
        "--calculate-per-token-loss", "average the LM loss over the loss-masked tokens of the "
        "whole global batch (default: the mean of each micro-batch's token mean); on with --sft"))

    def __post_init__(self):
        for name in ("micro_batch_size", "global_batch_size", "train_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size}")


@dataclass(kw_only=True)
class DataConfig:
    """Indexed datasets from tools/preprocess_data.py and their tokenizer."""

    data_path: Optional[List[str]] = field(default=None, metadata=_flag(
        "--data-path", "dataset prefixes, optionally weighted: 0.7 a_text_document 0.3 b_text_document",
        nargs="+"))
    split: str = field(default="969,30,1", metadata=_flag("--split", "train,valid,test weights"))
    data_cache_path: Optional[str] = field(default=None, metadata=_flag(
        "--data-cache-path", "where sample indices are cached; default beside the data"))
    tokenizer_type: str = field(default="ByteTokenizer", metadata=_flag(
        "--tokenizer-type", "SentencePieceTokenizer, HuggingFaceTokenizer or ByteTokenizer"))
    tokenizer_model: Optional[str] = field(default=None, metadata=_flag(
        "--tokenizer-model", "tokenizer file or directory"))
    sft: bool = field(default=False, metadata=_flag(
        "--sft", "supervised fine-tuning on chat data from preprocess_data.py --sft: one "
        "conversation per sample, padded, loss on assistant tokens only"))

    def __post_init__(self):
        if not self.data_path:
            raise ValueError("--data-path is missing; pass the prefix tools/preprocess_data.py wrote "
                             "(e.g. data/demo_text_document)")


@dataclass(kw_only=True)
class CheckpointConfig:
    """dist-checkpointing (torch_dist) in Megatron's directory layout."""

    save: Optional[str] = field(default=None, metadata=_flag("--save", "checkpoint directory to write"))
    load: Optional[str] = field(default=None, metadata=_flag(
        "--load", "checkpoint directory to resume from (the latest complete iteration)"))
    save_interval: Optional[int] = field(default=None, metadata=_flag(
        "--save-interval", "steps between checkpoints (the last step is always saved)"))
    ckpt_step: Optional[int] = field(default=None, metadata=_flag(
        "--ckpt-step", "load this iteration instead of the latest"))
    no_load_optim: bool = field(default=False, metadata=_flag(
        "--no-load-optim", "load weights only (fresh optimizer and schedule)"))
    finetune: bool = field(default=False, metadata=_flag(
        "--finetune", "load weights only and start at iteration 0 with a fresh optimizer, "
        "schedule and random state (from --pretrained-checkpoint when given, else --load)"))
    pretrained_checkpoint: Optional[str] = field(default=None, metadata=_flag(
        "--pretrained-checkpoint", "weights to start from when --load is unset or holds no "
        "checkpoint yet (implies --finetune for them; any TP/PP layout)"))
    ckpt_format: str = field(default="torch_dist", metadata=_flag("--ckpt-format", "torch_dist"))
    no_load_rng: bool = field(default=False, metadata=_flag(
        "--no-load-rng", "on --load, do not restore the saved random state"))
    no_verify_checkpoint: bool = field(default=False, metadata=_flag(
        "--no-verify-checkpoint", "on --load, skip the per-file checksum check"))
    overwrite_checkpoints: bool = field(default=False, metadata=_flag(
        "--overwrite-checkpoints", "let a run without --load write into a --save that holds "
        "checkpoints (it replaces the iterations it reaches)"))

    def __post_init__(self):
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError("--save-interval must be >= 1")
        if self.ckpt_format != "torch_dist":
            raise ValueError(f"--ckpt-format {self.ckpt_format!r}: only torch_dist is supported")


@dataclass(kw_only=True)
class LoggingConfig:
    log_interval: int = field(default=10, metadata=_flag("--log-interval", "steps between log lines"))
    tensorboard_dir: Optional[str] = field(default=None, metadata=_flag(
        "--tensorboard-dir", "write TensorBoard scalars here"))
    metrics_file: Optional[str] = field(default=None, metadata=_flag(
        "--metrics-file", "append one JSON object per logged step"))
    wandb_project: Optional[str] = field(default=None, metadata=_flag(
        "--wandb-project", "also log to Weights & Biases (needs wandb installed)"))
    wandb_exp_name: Optional[str] = field(default=None, metadata=_flag("--wandb-exp-name", "W&B run name"))

    def __post_init__(self):
        if self.log_interval < 1:
            raise ValueError("--log-interval must be >= 1")


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "jreg": JregConfig,
    "optim": OptimConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
}


def build_model_config(values: dict) -> ModelConfig:
    values = dict(values)
    preset = values.pop("model_preset", None)
    return ModelConfig.from_preset(preset, **values) if preset else ModelConfig(**values)


BUILDERS = {"model": build_model_config}
