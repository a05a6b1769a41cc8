"""Trainer configuration: optimizer, schedule, batches, data, checkpoints, logging."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_jreg.config import values as config_values
from megatron_jreg.config.megatron_lm import MegatronLMConfig
from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
from megatron_jreg.config.resolve import kept_schedule
from megatron_jreg.config.schema import option
from megatron_jreg.config.tokenizer_names import TOKENIZER_TYPES, tokenizer_type_error
from megatron_jreg.errors import ConfigError


def _normalize(config, **values) -> None:
    """Set fields of a frozen section while it is built (its own ``__post_init__``): the
    canonical form of what was given, such as the steps ``--train-samples`` stands for."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW through megatron-core's get_megatron_optimizer, and the LR/WD schedule."""

    lr: float = field(default=3e-4, metadata=option("--lr", "peak learning rate", gt=0))
    min_lr: float = field(default=0.0, metadata=option("--min-lr", "final learning rate", min=0))
    lr_warmup_iters: int = field(default=0, metadata=option(
        "--lr-warmup-iters", "linear warmup steps", min=0))
    lr_warmup_samples: int = field(default=0, metadata=option(
        "--lr-warmup-samples", "linear warmup, in samples", min=0))
    lr_warmup_fraction: Optional[float] = field(default=None, metadata=option(
        "--lr-warmup-fraction", "linear warmup as a fraction of the decay length", min=0, max=1))
    lr_warmup_init: float = field(default=0.0, metadata=option(
        "--lr-warmup-init", "learning rate at the start of the warmup", min=0))
    lr_decay_iters: Optional[int] = field(default=None, metadata=option(
        "--lr-decay-iters", "steps of decay; default --train-iters", min=1))
    lr_decay_samples: Optional[int] = field(default=None, metadata=option(
        "--lr-decay-samples", "samples of decay; default --train-samples", min=1))
    lr_decay_style: str = field(default="linear", metadata=option(
        "--lr-decay-style", "linear, cosine, constant or WSD"))
    lr_wsd_decay_iters: Optional[int] = field(default=None, metadata=option(
        "--lr-wsd-decay-iters", "WSD: steps of the final decay; default 10% of decay", min=1))
    lr_wsd_decay_samples: Optional[int] = field(default=None, metadata=option(
        "--lr-wsd-decay-samples", "WSD: samples of the final decay", min=1))
    lr_wsd_decay_style: str = field(default="exponential", metadata=option(
        "--lr-wsd-decay-style", "WSD: exponential, linear, cosine or minus_sqrt"))
    weight_decay: float = field(default=0.01, metadata=option(
        "--weight-decay", "AdamW weight decay", min=0))
    adam_beta1: float = field(default=0.9, metadata=option(
        "--adam-beta1", "Adam beta1", min=0, lt=1))
    adam_beta2: float = field(default=0.999, metadata=option(
        "--adam-beta2", "Adam beta2", min=0, lt=1))
    adam_eps: float = field(default=1e-8, metadata=option("--adam-eps", "Adam epsilon", gt=0))
    clip_grad: float = field(default=1.0, metadata=option(
        "--clip-grad", "global grad-norm clip (0 = off)", min=0))
    use_distributed_optimizer: bool = field(default=False, metadata=option(
        "--use-distributed-optimizer", "shard optimizer state over data-parallel ranks"))
    initial_loss_scale: float = field(default=2.0**32, metadata=option(
        "--initial-loss-scale", "fp16: initial dynamic loss scale; default 2^32, as in "
        "Megatron-LM (the first steps overflow and are skipped while the scale halves)", gt=0))
    override_opt_param_scheduler: bool = field(default=False, metadata=option(
        "--override-opt-param-scheduler",
        "on --load, use the schedule flags (--lr, --min-lr, warmup, decay) over the checkpoint's",
        aliases=["--override-opt_param-scheduler"]))
    use_checkpoint_opt_param_scheduler: bool = field(default=False, metadata=option(
        "--use-checkpoint-opt-param-scheduler",
        "on --load, keep the checkpoint's schedule whatever the flags say (neither flag: a "
        "difference is an error)", aliases=["--use-checkpoint-opt_param-scheduler"]))

    def __post_init__(self):
        config_values.check_fields(self)  # the metadata's bounds, however the config is built
        if self.lr_decay_style not in ("cosine", "linear", "constant", "WSD",
                                       "inverse-square-root"):
            raise ConfigError(
                f"--lr-decay-style {self.lr_decay_style!r}: choose cosine, linear, constant or WSD")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(
                f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr}) and --lr > 0")
        if min(self.lr_warmup_iters, self.lr_warmup_samples, self.lr_warmup_fraction or 0) < 0:
            raise ConfigError("--lr-warmup-iters, --lr-warmup-samples and --lr-warmup-fraction "
                             "must be >= 0")
        warmups = [name for name, value in (("--lr-warmup-iters", self.lr_warmup_iters),
                                            ("--lr-warmup-samples", self.lr_warmup_samples),
                                            ("--lr-warmup-fraction", self.lr_warmup_fraction))
                   if value]
        if len(warmups) > 1:  # Megatron-LM takes one of them
            raise ConfigError(f"{' and '.join(warmups)}: pass one warmup length")
        for unit in ("decay", "wsd_decay"):
            if (getattr(self, f"lr_{unit}_iters") is not None
                    and getattr(self, f"lr_{unit}_samples") is not None):
                flag = unit.replace("_", "-")
                raise ConfigError(f"--lr-{flag}-iters and --lr-{flag}-samples: pass one")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ConfigError("--override-opt-param-scheduler and "
                              "--use-checkpoint-opt-param-scheduler contradict each other; "
                              "pass one")

    def schedule_samples(self, train_samples: int, global_batch: int) -> dict:
        """The schedule's lengths in samples, by Megatron-LM's rule (its
        get_optimizer_param_scheduler): iteration flags times the global batch, sample
        flags as given, a warmup fraction of the decay length."""
        decay = (self.lr_decay_samples if self.lr_decay_samples is not None
                 else self.lr_decay_iters * global_batch if self.lr_decay_iters is not None
                 else train_samples)
        warmup = (self.lr_warmup_fraction * decay if self.lr_warmup_fraction is not None
                  else self.lr_warmup_samples or self.lr_warmup_iters * global_batch)
        wsd = (self.lr_wsd_decay_samples if self.lr_wsd_decay_samples is not None
               else (self.lr_wsd_decay_iters or max(1, decay // global_batch // 10)) * global_batch)
        return {"warmup": warmup, "decay": decay, "wsd": wsd}

    def keep_schedule(self, scheduler, global_batch: int) -> None:
        """Take, in place, the schedule of a scheduler a resumed run keeps
        (``config.resolve.kept_schedule`` of its values). The trainer resolves the kept
        schedule from the checkpoint before any work instead (``config.resolve``)."""
        names = ("max_lr", "min_lr", "lr_decay_style", "start_wd", "lr_warmup_steps",
                 "lr_decay_steps", "wsd_decay_steps", "lr_wsd_decay_style")
        values = kept_schedule({name: getattr(scheduler, name, None) for name in names},
                               global_batch)
        for name, value in values.items():
            setattr(self, name, value)

    def scheduler_mode(self) -> str:
        """How a resumed schedule is reconciled with the flags
        (checkpoint.scheduler_state.load_scheduler)."""
        if self.override_opt_param_scheduler:
            return "override"
        return "checkpoint" if self.use_checkpoint_opt_param_scheduler else "strict"


@dataclass(kw_only=True, frozen=True)
class TrainingConfig:
    """Batches, steps, evaluation and run control."""

    micro_batch_size: int = field(default=4, metadata=option(
        "--micro-batch-size", "sequences per micro-batch", min=1))
    global_batch_size: Optional[int] = field(default=None, metadata=option(
        "--global-batch-size", "sequences per step over all data-parallel ranks; default "
        "--micro-batch-size x data-parallel size, as in Megatron-LM", min=1))
    train_iters: Optional[int] = field(default=None, metadata=option(
        "--train-iters", "optimizer steps; default 100, or --train-samples / --global-batch-size",
        min=1))
    train_samples: Optional[int] = field(default=None, metadata=option(
        "--train-samples", "samples to train on: --train-samples / --global-batch-size steps "
        "(a partial last batch is dropped, as in Megatron-LM)", min=1))
    rampup_batch_size: Optional[list] = field(default=None, metadata=option(
        "--rampup-batch-size", "batch-size ramp-up: not supported yet", nargs=3))
    eval_interval: Optional[int] = field(default=None, metadata=option(
        "--eval-interval", "steps between validation runs; unset or 0: no validation (as in "
        "Megatron-LM, no validation during training)", min=0))
    eval_iters: int = field(default=100, metadata=option(
        "--eval-iters", "validation batches per run (0 = no validation, as --eval-interval 0)",
        min=0))
    seed: int = field(default=1234, metadata=option(
        "--seed", "seed of init, data order and dropout", min=0, max=2**32 - 1))
    exit_signal_handler: bool = field(default=True, metadata=option(
        "--exit-signal-handler", "on SIGTERM/SIGINT (and --exit-signal) save a checkpoint and "
        "exit cleanly"))
    exit_signal: str = field(default="SIGTERM", metadata=option(
        "--exit-signal", "one more signal that saves and exits (e.g. SIGUSR1 from Slurm's "
        "--signal)", choices=("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")))
    exit_duration_in_mins: Optional[float] = field(default=None, metadata=option(
        "--exit-duration-in-mins", "save and exit once the run has lasted this long", min=0))
    exit_on_nan: bool = field(default=True, metadata=option(
        "--exit-on-nan", "stop with exit code 3, before any save, at a step whose loss, JREG "
        "penalty or gradient norm is NaN/inf (--no-exit-on-nan skips such steps: no update)"))
    exit_interval: Optional[int] = field(default=None, metadata=option(
        "--exit-interval", "save and exit after this many steps (for tests and preemption drills)",
        min=1))
    calculate_per_token_loss: bool = field(default=False, metadata=option(
        "--calculate-per-token-loss", "average the LM loss over the loss-masked tokens of the "
        "whole global batch (default: the mean of each micro-batch's token mean); on with --sft"))

    def __post_init__(self):
        config_values.check_fields(self)
        if self.rampup_batch_size:
            raise ConfigError("--rampup-batch-size: not supported yet (the global batch is "
                             "constant); drop it")
        if self.train_samples is not None:
            # the steps --train-samples stands for, once the global batch is known (a config
            # built again from its own values holds both, equal)
            steps = (None if self.global_batch_size is None
                     else self.train_samples // max(self.global_batch_size, 1))
            if self.train_iters is not None and self.train_iters != steps:
                raise ConfigError("--train-iters and --train-samples: pass one (as in Megatron-LM)")
            _normalize(self, train_iters=steps)
        elif self.train_iters is None:
            _normalize(self, train_iters=100)
        if self.global_batch_size is None:
            return  # --micro-batch-size x data-parallel size: with_data_parallel, at the launch
        for name in ("micro_batch_size", "global_batch_size", "train_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1"
                                 + (" (--train-samples gives no full batch)"
                                    if name == "train_iters" and self.train_samples else ""))
        if self.global_batch_size % self.micro_batch_size:
            raise ConfigError(
                f"--global-batch-size {self.global_batch_size} is not divisible by "
                f"--micro-batch-size {self.micro_batch_size}")

    def with_data_parallel(self, data_parallel_size: int) -> "TrainingConfig":
        """This section on ``data_parallel_size`` data-parallel ranks: a global batch left
        out is --micro-batch-size x data-parallel size, as in Megatron-LM."""
        if self.global_batch_size is not None:
            return self
        return dataclasses.replace(
            self, global_batch_size=self.micro_batch_size * data_parallel_size)


@dataclass(kw_only=True)
class DataConfig:
    """Indexed datasets from tools/preprocess_data.py and their tokenizer."""

    data_path: Optional[List[str]] = field(default=None, metadata=option(
        "--data-path", "dataset prefixes, optionally weighted: "
        "0.7 a_text_document 0.3 b_text_document", nargs="+"))
    split: str = field(default="969,30,1", metadata=option("--split", "train,valid,test weights"))
    data_cache_path: Optional[str] = field(default=None, metadata=option(
        "--data-cache-path", "where sample indices are cached; default beside the data"))
    tokenizer_type: str = field(default="ByteTokenizer", metadata=option(
        "--tokenizer-type", ", ".join(TOKENIZER_TYPES)))
    tokenizer_model: Optional[str] = field(default=None, metadata=option(
        "--tokenizer-model", "tokenizer file or directory"))
    vocab_file: Optional[str] = field(default=None, metadata=option(
        "--vocab-file", "GPT2BPETokenizer: vocab.json"))
    merge_file: Optional[str] = field(default=None, metadata=option(
        "--merge-file", "GPT2BPETokenizer: merges.txt"))
    legacy_tokenizer: bool = field(default=False, metadata=option(
        "--legacy-tokenizer", "the data holds Megatron-LM's legacy tokenizer ids "
        "(preprocess_data.py --legacy-tokenizer): SentencePieceTokenizer's with <EOD> as the "
        "end of document, Llama2Tokenizer's with BOS first, HuggingFaceTokenizer's with its "
        "special tokens; the model's vocabulary is the same either way", const=True))
    dataloader_type: str = field(default="single", metadata=option(
        "--dataloader-type", "single (in order) or cyclic (Megatron-LM's shuffled order, "
        "reshuffled each epoch)"))
    eod_mask_loss: bool = field(default=False, metadata=option(
        "--eod-mask-loss", "no loss where the input token is the end of a document (the "
        "prediction of the next document's first token); the end-of-document target still "
        "counts", const=True))
    reset_position_ids: bool = field(default=False, metadata=option(
        "--reset-position-ids", "restart position ids after each end of document", const=True))
    reset_attention_mask: bool = field(default=False, metadata=option(
        "--reset-attention-mask", "attention blocked across documents: not supported yet",
        const=True))
    sft: bool = field(default=False, metadata=option(
        "--sft", "supervised fine-tuning on chat data from preprocess_data.py --sft: one "
        "conversation per sample, padded, loss on assistant tokens only"))
    imported_from: Optional[str] = field(default=None, metadata={
        "cli": False, "help": "the Hugging Face model a tools/convert_from_hf.py checkpoint "
        "was converted from (its run config has no data)"})
    tokenizer_identity: Optional[str] = field(default=None, metadata={
        "cli": False, "help": "the tokenizer the run trained with: the sha256 of its kind, size "
        "and files (data.tokenizers.tokenizer_identity); resume and the tools compare it"})

    def __post_init__(self):
        error = tokenizer_type_error(self.tokenizer_type)
        if error:
            raise ConfigError(error)
        if self.dataloader_type not in ("single", "cyclic"):
            raise ConfigError(f"--dataloader-type {self.dataloader_type!r}: single or cyclic "
                             "(external is not supported)")
        if (self.vocab_file or self.merge_file) and self.tokenizer_type != "GPT2BPETokenizer":
            raise ConfigError("--vocab-file and --merge-file are GPT2BPETokenizer's files; pass "
                             "--tokenizer-type GPT2BPETokenizer (or drop them)")
        if self.reset_attention_mask:
            raise ConfigError("--reset-attention-mask: not supported yet (attention is causal "
                             "over the whole sample); drop it")

    @classmethod
    def from_values(cls, values: dict) -> "DataConfig":
        """A training run's data settings: --data-path is required (a saved run config
        of an imported model, read with the class itself, has none)."""
        data = cls(**values)
        if not data.data_path:
            raise ConfigError("--data-path is missing; pass the prefix tools/preprocess_data.py "
                              "wrote (e.g. data/demo_text_document)")
        return data


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """dist-checkpointing (torch_dist) in Megatron's directory layout."""

    save: Optional[str] = field(default=None, metadata=option(
        "--save", "checkpoint directory to write"))
    load: Optional[str] = field(default=None, metadata=option(
        "--load", "checkpoint directory to resume from (the latest complete iteration)"))
    save_interval: Optional[int] = field(default=None, metadata=option(
        "--save-interval", "steps between checkpoints (the last step is always saved)", min=1))
    ckpt_step: Optional[int] = field(default=None, metadata=option(
        "--ckpt-step", "load this iteration instead of the latest", min=0))
    no_load_optim: bool = field(default=False, metadata=option(
        "--no-load-optim", "load weights only (fresh optimizer and schedule)"))
    finetune: bool = field(default=False, metadata=option(
        "--finetune", "load weights only and start at iteration 0 with a fresh optimizer, "
        "schedule and random state (from --pretrained-checkpoint when given, else --load)"))
    pretrained_checkpoint: Optional[str] = field(default=None, metadata=option(
        "--pretrained-checkpoint", "weights to start from when --load is unset or holds no "
        "checkpoint yet (implies --finetune for them; any TP/PP layout)"))
    use_checkpoint_args: bool = field(default=False, metadata=option(
        "--use-checkpoint-args", "take the architecture (and the tokenizer, when no tokenizer "
        "flag is given) from the checkpoint of --load, else --pretrained-checkpoint; an "
        "architecture flag that differs from it is refused", const=True))
    ckpt_format: str = field(default="torch_dist", metadata=option("--ckpt-format", "torch_dist"))
    dist_ckpt_optim_fully_reshardable: bool = field(default=False, metadata=option(
        "--dist-ckpt-optim-fully-reshardable", "save the distributed optimizer's state "
        "fully_reshardable (loads at any TP/PP layout; an all-gather of the optimizer state at "
        "each save) instead of Megatron-LM's default dp_reshardable (loads at the same TP/PP, "
        "any DP)"))
    ckpt_fully_parallel_save: bool = field(default=True, metadata=option(
        "--ckpt-fully-parallel-save", "spread the writing of the tensors every data-parallel "
        "rank holds alike (the weights) over those ranks (megatron-core's "
        "FullyParallelSaveStrategyWrapper over the data-parallel group) instead of the first "
        "one writing them all; the checkpoint is the same. On by default, as in Megatron-LM: "
        "--no-ckpt-fully-parallel-save (or --disable-ckpt-fully-parallel-save) turns it off",
        switches={"--disable-ckpt-fully-parallel-save": False}))
    ckpt_fully_parallel_load: bool = field(default=False, metadata=option(
        "--ckpt-fully-parallel-load", "on --load, each data-parallel rank reads a share of the "
        "tensors they all need and they exchange them (megatron-core's "
        "FullyParallelLoadStrategyWrapper) instead of every rank reading all it needs; any "
        "checkpoint but a pre-0.13 Megatron-LM one (dp_zero_gather_scatter)"))
    async_save: bool = field(default=False, metadata=option(
        "--async-save", "write the checkpoint's tensors in a background process per rank "
        "while training goes on; the iteration is marked whole (tracker, iter_ directory, "
        "jreg_complete.json) once every rank's files are on disk, at a later step or before "
        "the run exits. As in Megatron-LM it needs --use-persistent-ckpt-worker and is off "
        "without it (a line says so); the host copy of the state it writes takes memory "
        "while it is written"))
    use_persistent_ckpt_worker: bool = field(default=False, metadata=option(
        "--use-persistent-ckpt-worker", "with --async-save: one background process per rank, "
        "started at the first save, writes every checkpoint (Megatron-LM takes --async-save "
        "only with it)"))
    no_load_rng: bool = field(default=False, metadata=option(
        "--no-load-rng", "on --load, do not restore the saved random state"))
    no_verify_checkpoint: bool = field(default=False, metadata=option(
        "--no-verify-checkpoint", "on --load, skip the per-file checksum check"))
    allow_tokenizer_change: bool = field(default=False, metadata=option(
        "--allow-tokenizer-change", "continue from a checkpoint (--load, --pretrained-checkpoint) "
        "with a tokenizer other than the one it was trained with (its vocabulary must fit the "
        "saved embedding)"))
    overwrite_checkpoints: bool = field(default=False, metadata=option(
        "--overwrite-checkpoints", "let a run that does not continue the latest checkpoint of "
        "--save write into it when it holds checkpoints: a run without --load of it, one that "
        "restarts at iteration 0 from it (--finetune, --no-load-optim), or one resumed from an "
        "earlier iteration (--ckpt-step); it replaces the iterations it reaches"))

    def __post_init__(self):
        config_values.check_fields(self)
        if self.ckpt_format != "torch_dist":
            raise ConfigError(f"--ckpt-format {self.ckpt_format!r}: only torch_dist is supported"
                              + (" (also the only format --async-save writes)"
                                 if self.async_save else ""))
        if self.async_save and not self.use_persistent_ckpt_worker:
            # Megatron-LM's rule (its validate_args): --async-save is dropped without the
            # persistent worker; the trainer prints a line (config.megatron_lm.notes)
            _normalize(self, async_save=False)


@dataclass(kw_only=True, frozen=True)
class LoggingConfig:
    log_interval: int = field(default=100, metadata=option(
        "--log-interval", "steps between log lines", min=1))
    tensorboard_dir: Optional[str] = field(default=None, metadata=option(
        "--tensorboard-dir", "write TensorBoard scalars here"))
    metrics_file: Optional[str] = field(default=None, metadata=option(
        "--metrics-file", "append one JSON object per logged step (an existing file must "
        "already hold such lines)"))
    wandb_project: Optional[str] = field(default=None, metadata=option(
        "--wandb-project", "also log to Weights & Biases (needs wandb installed)"))
    wandb_exp_name: Optional[str] = field(default=None, metadata=option(
        "--wandb-exp-name", "W&B run name"))
    wandb_save_dir: Optional[str] = field(default=None, metadata=option(
        "--wandb-save-dir", "where W&B writes its local files; default --save's wandb/ directory "
        "(as in Megatron-LM), without --save wandb's own (./wandb)"))

    def __post_init__(self):
        config_values.check_fields(self)


SECTIONS = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "jreg": JregConfig,
    "optim": OptimConfig,
    "training": TrainingConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "megatron_lm": MegatronLMConfig,
}

# presets, and Megatron-LM's architecture defaults under a Megatron-LM sizing
BUILDERS = {"model": ModelConfig.from_values, "data": DataConfig.from_values}
