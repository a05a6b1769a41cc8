"""The experiment: every config section together, and the checks that span sections.

Each section (``megatron_jreg.config.run.SECTIONS``) validates its own fields where it
is defined. :meth:`ExperimentConfig.validate` runs, in one place and before any work, every
check that needs more than one section or the environment (world size, files on disk).
An experiment holds the settings as given; ``config.resolve`` makes the run they stand
for (the trainer's ``setup``), and that run is what trains and what a checkpoint records.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Dict, List, Mapping, Optional

from megatron_jreg.checkpoint import catalog
from megatron_jreg.checkpoint.catalog import TRACKER
from megatron_jreg.checkpoint.run_configs import launched_world_size
from megatron_jreg.config import yaml_settings
from megatron_jreg.config.megatron_lm import MegatronLMConfig
from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig, core_attention
from megatron_jreg.config.run import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    OptimConfig,
    TrainingConfig,
)
from megatron_jreg.config.shapes import check_tensor_split
from megatron_jreg.data.datasets.batches import data_prefixes
from megatron_jreg.data.datasets.gpt import GPTDataConfig, check_indexed_dataset
from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.errors import ConfigError
from megatron_jreg.training.checkpoint_args import missing_directory
from megatron_jreg.training.source import choose, loads_own_save

DESCRIPTION = "Pretrain a Llama model with JREG on megatron-core"


@dataclasses.dataclass(kw_only=True, frozen=True)
class ExperimentConfig:
    """One training run: the sections of ``SECTIONS``, by the same names."""

    model: ModelConfig
    parallel: ParallelConfig
    jreg: JregConfig
    optim: OptimConfig
    training: TrainingConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    megatron_lm: MegatronLMConfig
    # the settings as given per section (flags over YAML), to tell them from defaults: the
    # Megatron-LM notes say what became of a given flag. Not saved.
    given: Dict[str, dict] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # the checkpoint the run starts from when the settings already read it (under
    # --use-checkpoint-args, at parse time: training.source.StartingPoint). Not saved.
    start: Optional[object] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        # the one place a global batch left out is decided: --micro-batch-size x the
        # data-parallel size of this launch (Megatron-LM's rule)
        dp = self.parallel.data_parallel_size(launched_world_size())
        object.__setattr__(self, "training", self.training.with_data_parallel(dp))
        cp = self.parallel.context_parallel_size
        if self.model.seq_length % (2 * cp) and cp > 1:
            raise ConfigError(f"--seq-length {self.model.seq_length} must be a multiple of 2 x "
                              f"--context-parallel-size = {2 * cp} (each CP rank holds 2 of "
                              f"{2 * cp} equal chunks of every sequence); change one of them")

    # ---- construction and YAML ----------------------------------------------------------
    @classmethod
    def from_sections(cls, sections: Mapping[str, object],
                      given: Optional[Dict[str, dict]] = None,
                      start: Optional[object] = None) -> "ExperimentConfig":
        return cls(**{name: sections[name] for name in SECTIONS}, given=given or {}, start=start)

    @classmethod
    def from_yaml(cls, text: str) -> "ExperimentConfig":
        """The config a run saved (``run_config.yaml``)."""
        return cls.from_sections(yaml_settings.from_yaml_text(text, SECTIONS))

    def sections(self) -> Dict[str, object]:
        return {name: getattr(self, name) for name in SECTIONS}

    def to_yaml(self) -> str:
        return yaml_settings.to_yaml(self.sections())

    def to_dict(self) -> Dict[str, dict]:
        return {name: dataclasses.asdict(section) for name, section in self.sections().items()}

    # ---- derived ------------------------------------------------------------------------
    def data_prefixes(self) -> List[str]:
        return data_prefixes(self.data.data_path)

    def per_token_loss(self) -> bool:
        """The LM loss is the mean over the global batch's loss-masked tokens."""
        return self.training.calculate_per_token_loss or self.data.sft

    def wandb_dir(self) -> Optional[str]:
        """Where W&B writes its local files: --wandb-save-dir, else --save's ``wandb``
        directory (Megatron-LM's default); None without either (wandb's own, ./wandb), and
        without --wandb-project."""
        if not self.logging.wandb_project:
            return None
        if self.logging.wandb_save_dir:
            return self.logging.wandb_save_dir
        return os.path.join(self.checkpoint.save, "wandb") if self.checkpoint.save else None

    def outputs(self) -> List[tuple]:
        """Every path the run writes: (flag, path, is a directory, written by every rank)."""
        out = []
        if self.checkpoint.save:
            out.append(("--save", self.checkpoint.save, True, True))
        if self.logging.metrics_file:
            out.append(("--metrics-file", self.logging.metrics_file, False, False))
        if self.logging.tensorboard_dir:
            out.append(("--tensorboard-dir", self.logging.tensorboard_dir, True, False))
        wandb_dir = self.wandb_dir()
        if wandb_dir:
            out.append(("--wandb-save-dir", wandb_dir, True, False))
        if not self.data.sft:  # megatron-core's sample-index cache: every rank builds it
            cache = self.data.data_cache_path or os.path.join(
                os.path.dirname(os.path.abspath(self.data_prefixes()[0])), "index-cache")
            out.append(("--data-cache-path", cache, True, True))
        return out

    def gpt_data_config(self) -> GPTDataConfig:
        """The datasets' config (its construction checks ``--split``)."""
        return GPTDataConfig(data_path=list(self.data.data_path), split=self.data.split,
                             seq_length=self.model.seq_length, seed=self.training.seed,
                             cache_dir=self.data.data_cache_path,
                             eod_mask_loss=self.data.eod_mask_loss,
                             reset_position_ids=self.data.reset_position_ids,
                             num_dataset_builder_threads=self.megatron_lm.num_dataset_builder_threads)

    # ---- checks -------------------------------------------------------------------------
    def validate(self, world_size: Optional[int] = None,
                 tokenizer_vocab_size: Optional[int] = None) -> None:
        """Raise ValueError, naming the flag and the fix, for a run that cannot work.

        world_size: the processes launched (default: the launcher's WORLD_SIZE, 1 without
        torchrun). tokenizer_vocab_size: the built tokenizer's, to check ``--vocab-size``.
        """
        world = launched_world_size() if world_size is None else world_size
        self._check_layout(world)
        self._check_schedule()
        if (self.checkpoint.load and not self.checkpoint.pretrained_checkpoint
                and not loads_own_save(self.checkpoint)
                and not os.path.isdir(self.checkpoint.load)):
            raise ConfigError(missing_directory("--load", self.checkpoint.load))
        if self.logging.wandb_project and importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project needs wandb installed: pip install wandb "
                             "(or drop --wandb-project)")
        self._check_finetune()
        self.gpt_data_config()
        if self.data.sft:
            self._check_sft_data()
        for prefix in self.data_prefixes():
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise ConfigError(f"--data-path {prefix!r}: no {prefix}.bin/.idx; build it with "
                                 "tools/preprocess_data.py")
            check_indexed_dataset(prefix)  # .bin size as the .idx describes it, not empty
        vocab = self.model.vocab_size
        if tokenizer_vocab_size is not None and vocab is not None and vocab < tokenizer_vocab_size:
            raise ConfigError(
                f"--vocab-size {vocab} is smaller than the tokenizer's "
                f"{tokenizer_vocab_size}; drop --vocab-size to use the tokenizer's")

    def _check_schedule(self) -> None:
        o, t = self.optim, self.training
        g = t.global_batch_size
        lengths = o.schedule_samples(t.train_samples or t.train_iters * g, g)
        if lengths["warmup"] >= lengths["decay"]:
            warmup = (f"--lr-warmup-fraction {o.lr_warmup_fraction}" if o.lr_warmup_fraction
                      else f"--lr-warmup-samples {o.lr_warmup_samples}" if o.lr_warmup_samples
                      else f"--lr-warmup-iters {o.lr_warmup_iters}")
            decay = (lengths["decay"] // g if o.lr_decay_samples is None and not t.train_samples
                     else f"{lengths['decay']} samples")
            raise ConfigError(f"{warmup} must be below the decay length {decay} (--lr-decay-iters "
                             "or --lr-decay-samples, default the training length)")
        if o.lr_warmup_init > o.lr:
            raise ConfigError(f"--lr-warmup-init {o.lr_warmup_init} must not exceed --lr {o.lr}")
        p = self.parallel
        if p.overlap_param_gather and not (o.use_distributed_optimizer and p.overlap_grad_reduce):
            raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer and "
                             "--overlap-grad-reduce (as in Megatron-LM)")

    def _check_finetune(self) -> None:
        c = self.checkpoint
        if c.pretrained_checkpoint and not os.path.isdir(c.pretrained_checkpoint):
            raise ConfigError(missing_directory("--pretrained-checkpoint", c.pretrained_checkpoint))
        if c.finetune and not (c.load or c.pretrained_checkpoint):
            raise ConfigError("--finetune loads weights from --pretrained-checkpoint or --load; "
                             "pass one of them")

    def _check_sft_data(self) -> None:
        """--sft reads chat datasets (token and loss-mask pairs), unweighted."""
        items = list(self.data.data_path)
        if data_prefixes(items) != items:
            raise ConfigError("--sft takes dataset prefixes without weights (the conversations of "
                             "all of them are used); drop the weights from --data-path")
        for prefix in items:
            dataset = SFTDataset(prefix)  # an InputError names the file and the fix
            built_with = dataset.metadata.get("tokenizer_type")
            if built_with and built_with != self.data.tokenizer_type:
                raise ConfigError(
                    f"--data-path {prefix}: built with --tokenizer-type {built_with}, but this run "
                    f"uses {self.data.tokenizer_type}; pass the same tokenizer")

    def _check_layout(self, world: int) -> None:
        """The model and the batch split over TP x PP x DP as launched."""
        model, parallel = self.model, self.parallel
        parallel.virtual_stages(model.num_layers)
        tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        multiple = model.make_vocab_size_divisible_by
        if multiple % tp and not self.checkpoint.load:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} does not divide --make-vocab-size-divisible-by "
                f"{multiple}: the vocabulary is padded to a multiple of it under every layout; "
                f"pass --make-vocab-size-divisible-by {multiple * tp // math.gcd(multiple, tp)}")
        if model.num_attention_heads % tp or model.query_groups % tp:
            raise ConfigError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
                f"{model.num_attention_heads} and the query groups {model.query_groups}")
        check_tensor_split(model, tp)  # before the world size: the same answer at any launch
        cp = parallel.context_parallel_size
        self._check_context_parallel()
        if parallel.sequence_parallel and (model.seq_length // cp) % tp:
            raise ConfigError(f"--seq-length {model.seq_length} must be divisible by TP {tp} "
                              "under --sequence-parallel"
                              + (f" x CP {cp} (each CP rank's part splits over TP)"
                                 if cp > 1 else ""))
        if world % (tp * pp * cp):
            raise ConfigError(f"{world} processes cannot hold TP {tp} x PP {pp}"
                             + (f" x CP {cp}" if cp > 1 else "") + "; launch a multiple")
        self._check_experts(world // (tp * pp))
        if self.megatron_lm.no_position_embedding and model.position_embedding_type != "rope":
            raise ConfigError(f"--no-position-embedding with --position-embedding-type "
                             f"{model.position_embedding_type}: a model without position "
                             "information is not supported; drop --no-position-embedding")
        per_step = self.training.micro_batch_size * parallel.data_parallel_size(world)
        if self.training.global_batch_size % per_step:
            raise ConfigError(
                f"--global-batch-size {self.training.global_batch_size} is not divisible by "
                f"--micro-batch-size x data-parallel size = {per_step}")

    def _check_context_parallel(self) -> None:
        """--context-parallel-size: an attention that splits the sequence, and a
        --cp-comm-type that attention has (the split itself is checked with the flags)."""
        model, cp = self.model, self.parallel.context_parallel_size
        if cp == 1:
            return
        attention = core_attention(model)[0]
        if attention == "megatron":
            raise ConfigError(f"--attention-backend {model.attention_backend}: megatron-core's "
                             "local attention has no context parallelism; drop the flag (SDPA, or "
                             "Transformer Engine's attention) or --context-parallel-size")
        kind = self.parallel.cp_comm_types(model.num_layers, attention == "transformer_engine")
        # all-to-all exchanges heads for sequence: each rank's heads (and K/V groups) must
        # split over the CP ranks of the exchange (a2a+p2p's first level), as TE requires
        tp = self.parallel.tensor_model_parallel_size
        heads, groups = model.num_attention_heads // tp, model.query_groups // tp
        size = {"a2a": cp, "a2a+p2p": (self.parallel.hierarchical_context_parallel_sizes
                                        or [cp])[0]}.get(kind)
        if size and (heads % size or groups % size):
            raise ConfigError(
                f"--cp-comm-type {kind} splits each TP rank's {heads} attention heads and "
                f"{groups} query groups over {size} CP ranks, which must divide both; use "
                "--cp-comm-type p2p or all_gather, or another --context-parallel-size")

    def _check_experts(self, dp: int) -> None:
        """Mixture-of-experts settings that only fail inside megatron's forward otherwise."""
        model, parallel = self.model, self.parallel
        ep, tp = parallel.expert_model_parallel_size, parallel.tensor_model_parallel_size
        if not model.num_experts:
            if ep > 1:
                raise ConfigError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts "
                                 "model; add --num-experts or drop it")
            return
        if tp > 1 and not parallel.sequence_parallel:
            raise ConfigError("--num-experts with --tensor-model-parallel-size > 1 needs "
                             "--sequence-parallel (as in Megatron-LM); add it")
        if model.num_experts % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} must divide --num-experts "
                             f"{model.num_experts}")
        if dp % ep:
            raise ConfigError(f"--expert-model-parallel-size {ep} must divide the data-parallel "
                             f"size {dp} (the experts are split over data-parallel ranks)")

    def check_save_lineage(self, found: catalog.Catalog) -> None:
        """One lineage per --save, judged on ``found`` (``--save``'s scan, made by the run
        that holds its lock: training.checkpointing.Checkpointer.take_save_lock): a run
        writes into a --save that holds iterations only to continue the latest of them. Any
        other start (a fresh run, --finetune or --no-load-optim from --save's own weights,
        which restart at iteration 0, or --ckpt-step of an earlier iteration) would replace
        that run's iterations with another run's and move its tracker back, unless
        --overwrite-checkpoints says so."""
        c = self.checkpoint
        save, load = c.save, c.load
        if not save or c.overwrite_checkpoints:
            return
        held = found.held
        if not held:
            return
        shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
        if not (load and os.path.realpath(load) == os.path.realpath(save)):
            raise ConfigError(
                f"--save {save} already holds checkpoints ({shown}) and this run does not resume "
                f"from them: pass --load {save} to continue that run, another --save for a new "
                "one, or --overwrite-checkpoints to replace them")
        restart = self._restart_from_save(found)
        if restart:
            raise ConfigError(
                f"--save {save} already holds checkpoints ({shown}) and this run {restart}, so "
                "its saves would replace them: pass another --save for the new run (--load "
                f"{save} still reads from there), or --overwrite-checkpoints to replace them")
        step = c.ckpt_step
        # whole ones only (a torn one holds nothing to lose); a whole copy a killed save
        # left counts: the run's lock puts it back as iter_N before the first save
        later = [f"iter_{i:07d}" for i in found.later_than(step)] if step is not None else []
        if later:
            names = ", ".join(later[:3]) + (", ..." if len(later) > 3 else "")
            raise ConfigError(
                f"--ckpt-step {step} resumes from an earlier iteration of --save {save}, which "
                f"holds later ones ({names}): this run's saves would replace them and set "
                f"{TRACKER} back; drop --ckpt-step to continue from the latest, pass another "
                f"--save to branch from iteration {step}, or --overwrite-checkpoints to replace "
                "them")

    def _restart_from_save(self, found: catalog.Catalog) -> Optional[str]:
        """Why a run whose --load is its --save starts at iteration 0 instead of continuing
        the checkpoint there (the words of the refusal), or None when it continues it. The
        run's own choice (training.source.choose): --load when it holds a checkpoint, else
        --pretrained-checkpoint; --finetune without --pretrained-checkpoint and
        --no-load-optim take --load's weights only."""
        c = self.checkpoint
        if choose(c, found).flag == "--pretrained-checkpoint":
            return (f"starts at iteration 0 from --pretrained-checkpoint "
                    f"{c.pretrained_checkpoint} (--load holds no whole checkpoint to continue)")
        if c.finetune and not c.pretrained_checkpoint:
            return "starts at iteration 0 from the weights there (--finetune)"
        if c.no_load_optim:
            return "starts at iteration 0 from the weights there (--no-load-optim)"
        return None
