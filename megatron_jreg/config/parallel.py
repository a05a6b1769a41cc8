"""How the model is split over ranks (the run's ``parallel`` section), and activation
recomputation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_jreg.config import values as config_values
from megatron_jreg.config.schema import option
from megatron_jreg.errors import ConfigError

# megatron-core's context-parallel communication kinds (Transformer Engine's attention)
CP_COMM_TYPES = ("p2p", "a2a", "all_gather", "a2a+p2p")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the model is split over ranks, and activation recomputation."""

    tensor_model_parallel_size: int = field(default=1, metadata=option(
        "--tensor-model-parallel-size", "tensor-parallel ranks", min=1))
    pipeline_model_parallel_size: int = field(default=1, metadata=option(
        "--pipeline-model-parallel-size", "pipeline stages", min=1))
    num_layers_per_virtual_pipeline_stage: Optional[int] = field(default=None, metadata=option(
        "--num-layers-per-virtual-pipeline-stage", "layers per model chunk (interleaved pipeline)",
        min=1))
    virtual_pipeline_model_parallel_size: Optional[int] = field(default=None, metadata=option(
        "--num-virtual-stages-per-pipeline-rank", "model chunks per pipeline rank (interleaved "
        "pipeline); the other way to set --num-layers-per-virtual-pipeline-stage",
        aliases=["--virtual-pipeline-model-parallel-size"], min=1))
    sequence_parallel: bool = field(default=False, metadata=option(
        "--sequence-parallel", "split norms/dropout activations over TP ranks along the "
        "sequence (turned off at TP 1, as in Megatron-LM)"))  # config.resolve turns it off
    overlap_grad_reduce: bool = field(default=False, metadata=option(
        "--overlap-grad-reduce", "overlap the data-parallel gradient reduction with backward",
        const=True))
    overlap_param_gather: bool = field(default=False, metadata=option(
        "--overlap-param-gather", "overlap the distributed optimizer's parameter all-gather with "
        "the next forward (needs --use-distributed-optimizer and --overlap-grad-reduce)",
        const=True))
    distributed_timeout_minutes: int = field(default=30, metadata=option(
        "--distributed-timeout-minutes", "process groups' timeout (Megatron-LM's: 10)", min=1))
    context_parallel_size: int = field(default=1, metadata=option(
        "--context-parallel-size", "context-parallel ranks: each holds 2 of 2 x CP chunks of "
        "every sequence (--seq-length must be a multiple of 2 x CP)", min=1))
    cp_comm_type: Optional[list] = field(default=None, metadata=option(
        "--cp-comm-type", "context-parallel attention's communication, one for all layers or "
        "one per layer: p2p, a2a, all_gather (allgather) or a2a+p2p with Transformer Engine "
        "(default p2p); all_gather only without it (its default)", nargs="+"))
    hierarchical_context_parallel_sizes: Optional[List[int]] = field(default=None, metadata=option(
        "--hierarchical-context-parallel-sizes", "the CP group's levels for --cp-comm-type "
        "a2a+p2p (their product is --context-parallel-size)", nargs="+", min=1))
    expert_model_parallel_size: int = field(default=1, metadata=option(
        "--expert-model-parallel-size", "expert-parallel ranks (--num-experts models): the "
        "experts are split over this many data-parallel ranks", min=1))
    recompute_granularity: Optional[str] = field(default=None, metadata=option(
        "--recompute-granularity", "full or selective activation recomputation"))
    recompute_method: Optional[str] = field(default=None, metadata=option(
        "--recompute-method", "uniform or block (full recompute); default uniform"))
    recompute_num_layers: Optional[int] = field(default=None, metadata=option(
        "--recompute-num-layers", "layers per recompute unit (full recompute); default 1", min=1))
    recompute_modules: Optional[list] = field(default=None, metadata=option(
        "--recompute-modules", "selective recompute modules, e.g. core_attn mlp layernorm "
        "(layernorm: the local implementation's norms; Transformer Engine fuses them into its "
        "linears, where it has no effect, as the start-up line says)", nargs="+"))
    recompute_activations: bool = field(default=False, metadata=option(
        "--recompute-activations", "= --recompute-granularity selective (as in Megatron-LM)",
        const=True))

    def __post_init__(self):
        config_values.check_fields(self)
        self._check_context_parallel()
        if self.recompute_activations:
            # Megatron-LM's meaning of the flag (the section is frozen once built)
            object.__setattr__(self, "recompute_granularity", "selective")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ConfigError(
                f"--recompute-granularity {self.recompute_granularity!r}: choose full or selective")
        if self.recompute_granularity == "full":
            object.__setattr__(self, "recompute_method", self.recompute_method or "uniform")
            object.__setattr__(self, "recompute_num_layers", self.recompute_num_layers or 1)

    def _check_context_parallel(self) -> None:
        cp, kinds = self.context_parallel_size, self.cp_comm_type
        if kinds is not None:
            if not kinds:
                raise ConfigError(f"--cp-comm-type: no kind given; give one "
                                  f"({', '.join(CP_COMM_TYPES)}) or one per layer, or drop it")
            kinds = ["all_gather" if k == "allgather" else k for k in kinds]
            unknown = [k for k in kinds if k not in CP_COMM_TYPES]
            if unknown:
                raise ConfigError(f"--cp-comm-type {unknown[0]}: choose among "
                                  f"{', '.join(CP_COMM_TYPES)} (allgather = all_gather)")
            object.__setattr__(self, "cp_comm_type", kinds)
        sizes = self.hierarchical_context_parallel_sizes
        if sizes is not None and math.prod(sizes) != cp:
            raise ConfigError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))}: "
                              f"their product must be --context-parallel-size {cp}")
        if cp > 1 and "a2a+p2p" in (kinds or []) and sizes is None:
            raise ConfigError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes "
                              "(as in Megatron-LM); add it or choose p2p")

    def cp_comm_types(self, num_layers: int, transformer_engine: bool) -> str:
        """megatron's ``cp_comm_type`` for the attention that runs: Megatron-LM's default
        p2p with Transformer Engine, all_gather without it (the only kind that attention
        has). One value per layer is taken when they are all one kind: megatron-core 0.16.1
        reads layer N's entry of a list at index N (``TransformerLayer``, layers counted
        from 1), which shifts every layer's kind and fails at the last."""
        kinds = self.cp_comm_type or ["p2p" if transformer_engine else "all_gather"]
        if len(kinds) not in (1, num_layers):
            raise ConfigError(f"--cp-comm-type: {len(kinds)} values for {num_layers} layers; "
                              "give one, or one per layer")
        if (self.context_parallel_size > 1 and not transformer_engine
                and set(kinds) != {"all_gather"}):
            other = next(k for k in kinds if k != "all_gather")
            raise ConfigError(f"--cp-comm-type {other} needs Transformer Engine's attention; "
                              "without it context parallelism all-gathers keys and values: pass "
                              "--cp-comm-type all_gather or drop the flag")
        if len(set(kinds)) > 1:
            raise ConfigError(f"--cp-comm-type {' '.join(kinds)}: layers of different kinds are "
                              "not supported (megatron-core 0.16.1 gives each layer the next "
                              "layer's kind and fails at the last); give one kind for all layers")
        return kinds[0]

    def data_parallel_size(self, world: int) -> int:
        """Data-parallel ranks of ``world`` processes: what TP x PP x CP leaves (at least 1)."""
        return max(1, world // (self.tensor_model_parallel_size
                                * self.pipeline_model_parallel_size * self.context_parallel_size))

    def virtual_stages(self, num_layers: int) -> Optional[int]:
        """Model chunks per pipeline rank, or None without interleaving; validates the split."""
        pp = self.pipeline_model_parallel_size
        if num_layers % pp:
            raise ConfigError(
                f"--num-layers {num_layers} is not divisible by "
                f"--pipeline-model-parallel-size {pp}")
        per_vp = self.num_layers_per_virtual_pipeline_stage
        stages = self.virtual_pipeline_model_parallel_size
        if per_vp is not None and stages is not None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage and "
                             "--num-virtual-stages-per-pipeline-rank: pass one (as in Megatron-LM)")
        if stages is not None:
            if stages < 1 or (num_layers // pp) % stages:
                raise ConfigError(f"--num-virtual-stages-per-pipeline-rank {stages} must divide "
                                  f"the {num_layers // pp} layers of each pipeline stage")
            if stages > 1 and pp < 2:
                raise ConfigError("--num-virtual-stages-per-pipeline-rank needs pipeline "
                                 "parallelism (PP > 1)")
            return stages if stages > 1 else None
        if per_vp is None:
            return None
        if pp < 2:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs pipeline "
                              "parallelism (PP > 1)")
        if (num_layers // pp) % per_vp:
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {per_vp} must divide the "
                f"{num_layers // pp} layers of each pipeline stage")
        chunks = num_layers // pp // per_vp
        return chunks if chunks > 1 else None
