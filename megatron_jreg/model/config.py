"""Model, parallelism and JREG configuration: one small validated dataclass per concern.

Field metadata ``flag`` names the Megatron-LM command-line flag a field answers to; the
trainer's argument parser is generated from these dataclasses.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Optional

from megatron_jreg.jreg import WEIGHTINGS

# Llama-style presets. Heads, FFN size, query groups and sequence length are ours (the paper
# gives layers and hidden size): head dim 64 at 170m, 128 at 1b/3b; FFN = 8/3 * hidden
# rounded up to a multiple of 256; sequence 2048. Parameter counts at a 32000-token vocab:
# 170m -> 134M, 1b -> 0.95B, 3b -> 3.6B (3.4B without the untied output layer).
PRESETS = {
    "tiny": dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                 ffn_hidden_size=192, seq_length=128),
    "170m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, num_query_groups=12,
                 ffn_hidden_size=2048, seq_length=2048),
    "1b": dict(num_layers=16, hidden_size=2048, num_attention_heads=16, num_query_groups=8,
               ffn_hidden_size=5632, seq_length=2048),
    "3b": dict(num_layers=30, hidden_size=3072, num_attention_heads=24, num_query_groups=8,
               ffn_hidden_size=8192, seq_length=2048),
}


TRANSFORMER_IMPLS = ("auto", "local", "transformer_engine")


@functools.lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """True when Transformer Engine imports (its megatron-core extension included)."""
    try:
        import transformer_engine  # noqa: F401
        from megatron.core.extensions import transformer_engine as _te  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not match this torch/CUDA
        return False
    return True


def resolve_transformer_impl(impl: str) -> tuple:
    """(``local`` or ``transformer_engine``, why) for ``--transformer-impl impl``."""
    if impl == "auto":
        if transformer_engine_available():
            return "transformer_engine", "Transformer Engine is installed"
        return "local", ("Transformer Engine is not installed; "
                         "pip install transformer-engine[pytorch] to use it")
    if impl == "transformer_engine" and not transformer_engine_available():
        raise ValueError("--transformer-impl transformer_engine needs Transformer Engine installed; "
                         "install it or use --transformer-impl local (or auto)")
    return impl, "requested with --transformer-impl"


def _flag(name: str, help_text: str, **extra) -> dict:
    return {"flag": name, "help": help_text, **extra}


@dataclass(kw_only=True)
class ModelConfig:
    """A Llama-form GPT: RMSNorm, SwiGLU, RoPE, no linear biases, untied embeddings."""

    model_preset: Optional[str] = field(default=None, metadata=_flag(
        "--model-preset", "tiny, 170m, 1b or 3b; explicit size flags override it"))
    num_layers: int = field(default=4, metadata=_flag("--num-layers", "Transformer layers L"))
    hidden_size: int = field(default=64, metadata=_flag("--hidden-size", "hidden size"))
    num_attention_heads: int = field(default=4, metadata=_flag(
        "--num-attention-heads", "attention heads"))
    num_query_groups: Optional[int] = field(default=None, metadata=_flag(
        "--num-query-groups", "key/value groups (grouped-query attention); default = heads"))
    ffn_hidden_size: Optional[int] = field(default=None, metadata=_flag(
        "--ffn-hidden-size", "SwiGLU inner size; default 8/3 hidden rounded up to 256"))
    seq_length: int = field(default=128, metadata=_flag("--seq-length", "training sequence length"))
    max_position_embeddings: Optional[int] = field(default=None, metadata=_flag(
        "--max-position-embeddings", "longest sequence the model serves; default seq length"))
    vocab_size: Optional[int] = field(default=None, metadata=_flag(
        "--vocab-size", "vocabulary size; default the tokenizer's"))
    make_vocab_size_divisible_by: int = field(default=128, metadata=_flag(
        "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this, whatever "
        "the TP size (Megatron-LM multiplies by TP; here the model does not depend on the "
        "layout), so TP must divide it"))
    padded_vocab: Optional[int] = field(default=None, metadata={
        "cli": False, "help": "embedding rows as built: set by the trainer (from a loaded "
        "checkpoint's embedding when resuming) and saved in run_config.yaml"})
    rotary_base: int = field(default=10000, metadata=_flag("--rotary-base", "RoPE base"))
    norm_epsilon: float = field(default=1e-5, metadata=_flag("--norm-epsilon", "RMSNorm epsilon"))
    init_method_std: float = field(default=0.02, metadata=_flag(
        "--init-method-std", "std of the normal weight init"))
    hidden_dropout: float = field(default=0.0, metadata=_flag("--hidden-dropout", "dropout"))
    attention_dropout: float = field(default=0.0, metadata=_flag(
        "--attention-dropout", "attention dropout"))
    bf16: bool = field(default=False, metadata=_flag("--bf16", "bf16 params and activations"))
    fp16: bool = field(default=False, metadata=_flag("--fp16", "fp16 with dynamic loss scaling"))
    transformer_impl: str = field(default="auto", metadata=_flag(
        "--transformer-impl", "auto (Transformer Engine when it imports, else local), "
        "transformer_engine or local (torch)"))
    num_experts: Optional[int] = field(default=None, metadata=_flag(
        "--num-experts", "mixture-of-experts layers: not supported with JREG yet"))

    def __post_init__(self):
        if self.model_preset is not None:
            if self.model_preset not in PRESETS:
                raise ValueError(f"--model-preset {self.model_preset!r}: choose one of {sorted(PRESETS)}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; pick heads that divide the hidden size")
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ValueError(
                f"--num-query-groups {groups} must divide --num-attention-heads "
                f"{self.num_attention_heads}")
        if self.bf16 and self.fp16:
            raise ValueError("--bf16 and --fp16 are exclusive; pass one")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl {self.transformer_impl!r}: choose one of "
                             f"{', '.join(TRANSFORMER_IMPLS)}")
        if self.num_experts:
            raise ValueError(
                f"--num-experts {self.num_experts}: not supported with JREG yet: the JREG layer "
                "measures dense Transformer layers only; drop --num-experts")
        if self.make_vocab_size_divisible_by < 1:
            raise ValueError(f"--make-vocab-size-divisible-by must be >= 1, got "
                             f"{self.make_vocab_size_divisible_by}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < self.seq_length:
            raise ValueError(
                f"--max-position-embeddings {self.max_position_embeddings} is below --seq-length "
                f"{self.seq_length}")

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "ModelConfig":
        if preset not in PRESETS:
            raise ValueError(f"--model-preset {preset!r}: choose one of {sorted(PRESETS)}")
        return cls(model_preset=preset, **{**PRESETS[preset], **overrides})

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self) -> int:
        """Embedding rows: ``padded_vocab`` when set (a resumed checkpoint's), else the
        vocabulary rounded up to ``make_vocab_size_divisible_by``; never a function of the
        parallel layout, so one seed gives one model under every TP/PP/DP split."""
        if self.padded_vocab is not None:
            return self.padded_vocab
        if self.vocab_size is None:
            raise ValueError("vocab size unknown: set --vocab-size or give a tokenizer")
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass(kw_only=True)
class ParallelConfig:
    """How the model is split over ranks, and activation recomputation."""

    tensor_model_parallel_size: int = field(default=1, metadata=_flag(
        "--tensor-model-parallel-size", "tensor-parallel ranks"))
    pipeline_model_parallel_size: int = field(default=1, metadata=_flag(
        "--pipeline-model-parallel-size", "pipeline stages"))
    num_layers_per_virtual_pipeline_stage: Optional[int] = field(default=None, metadata=_flag(
        "--num-layers-per-virtual-pipeline-stage", "layers per model chunk (interleaved pipeline)"))
    sequence_parallel: bool = field(default=False, metadata=_flag(
        "--sequence-parallel", "split norms/dropout activations over TP ranks along the sequence"))
    context_parallel_size: int = field(default=1, metadata=_flag(
        "--context-parallel-size", "context-parallel ranks: not supported with JREG yet"))
    expert_model_parallel_size: int = field(default=1, metadata=_flag(
        "--expert-model-parallel-size", "expert-parallel ranks: not supported with JREG yet"))
    recompute_granularity: Optional[str] = field(default=None, metadata=_flag(
        "--recompute-granularity", "full or selective activation recomputation"))
    recompute_method: Optional[str] = field(default=None, metadata=_flag(
        "--recompute-method", "uniform or block (full recompute); default uniform"))
    recompute_num_layers: Optional[int] = field(default=None, metadata=_flag(
        "--recompute-num-layers", "layers per recompute unit (full recompute); default 1"))
    recompute_modules: Optional[list] = field(default=None, metadata=_flag(
        "--recompute-modules", "selective recompute modules, e.g. core_attn mlp layernorm",
        nargs="+"))

    def __post_init__(self):
        if self.tensor_model_parallel_size < 1 or self.pipeline_model_parallel_size < 1:
            raise ValueError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if self.context_parallel_size != 1:
            raise ValueError(
                f"--context-parallel-size {self.context_parallel_size}: not supported with JREG "
                "yet: each layer's displacement is a mean over the whole sequence, which context "
                "parallelism splits over ranks; use --sequence-parallel with TP, or more data "
                "parallelism")
        if self.expert_model_parallel_size != 1:
            raise ValueError(
                f"--expert-model-parallel-size {self.expert_model_parallel_size}: not supported "
                "with JREG yet: the JREG layer measures dense Transformer layers only")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(
                f"--recompute-granularity {self.recompute_granularity!r}: choose full or selective")
        if self.recompute_granularity == "full":
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1

    def virtual_stages(self, num_layers: int) -> Optional[int]:
        """Model chunks per pipeline rank, or None without interleaving; validates the split."""
        pp = self.pipeline_model_parallel_size
        if num_layers % pp:
            raise ValueError(
                f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
        per_vp = self.num_layers_per_virtual_pipeline_stage
        if per_vp is None:
            return None
        if pp < 2:
            raise ValueError("--num-layers-per-virtual-pipeline-stage needs pipeline parallelism (PP > 1)")
        if (num_layers // pp) % per_vp:
            raise ValueError(
                f"--num-layers-per-virtual-pipeline-stage {per_vp} must divide the "
                f"{num_layers // pp} layers of each pipeline stage")
        chunks = num_layers // pp // per_vp
        return chunks if chunks > 1 else None


@dataclass(kw_only=True)
class JregConfig:
    """The regularizer L = L_CE + lambda * sum_l w_l(alpha) Psi_l."""

    lam: float = field(default=0.0, metadata=_flag(
        "--jreg-lambda", "JREG strength lambda; 0 measures the displacement without a penalty"))
    alpha: float = field(default=1.0, metadata=_flag(
        "--jreg-alpha", "depth weighting alpha of w_l(alpha)"))
    weighting: str = field(default="softmax", metadata=_flag(
        "--jreg-weighting", "softmax (default), power or final"))
    impl: str = field(default="auto", metadata=_flag(
        "--jreg-impl", "displacement kernel: auto, fused or torch"))

    def __post_init__(self):
        if self.lam < 0:
            raise ValueError(f"--jreg-lambda must be >= 0, got {self.lam}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"--jreg-weighting {self.weighting!r}: choose one of {sorted(WEIGHTINGS)}")
        if self.impl not in ("auto", "fused", "torch"):
            raise ValueError(f"--jreg-impl {self.impl!r}: choose auto, fused or torch")


def to_dict(config) -> dict:
    return dataclasses.asdict(config)
