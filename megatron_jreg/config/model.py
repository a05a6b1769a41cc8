"""Model, parallelism and JREG configuration: one small validated dataclass per concern.

Field metadata ``flag`` names the Megatron-LM command-line flag a field answers to; the
trainer's argument parser is generated from these dataclasses. Architecture flags mean
what they mean in Megatron-LM; a model the JREG trainer cannot build yet is refused by
name (never replaced by another). Presets are named bundles of the same flags.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

from megatron_jreg.config import values as config_values
from megatron_jreg.config.families import check_experts, family_of
from megatron_jreg.config.parallel import ParallelConfig  # noqa: F401 (the run's sections are here)
from megatron_jreg.config.presets import (
    MEGATRON_LM_MODEL_DEFAULTS,
    PRESET_FLAGS,
    SIZING,
    preset_flags,
)
from megatron_jreg.config.schema import option, read_flags
from megatron_jreg.config.shapes import check_head_size
from megatron_jreg.errors import ConfigError
from megatron_jreg.jreg import WEIGHTINGS

# --attention-backend: Megatron-LM's values, and sdpa (PyTorch's fused attention)
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local", "sdpa")
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
        raise ConfigError("--transformer-impl transformer_engine needs Transformer Engine "
                          "installed; install it or use --transformer-impl local (or auto)")
    return impl, "requested with --transformer-impl"


def resolve_attention_backend(backend: str, impl: str) -> tuple:
    """(the core attention that runs: ``sdpa``, ``megatron`` (megatron-core's local
    DotProductAttention) or ``transformer_engine``, why) for ``--attention-backend``.

    With Transformer Engine, its own backends stay TE's choice; ``sdpa`` is this module
    under any implementation. Without TE, ``auto``, ``flash`` and ``fused`` are SDPA on every
    device (a CPU run builds the model a GPU run builds; SDPA was also 3x faster than
    megatron's attention in a tiny CPU run), ``local`` and ``unfused`` megatron's own."""
    if backend == "sdpa":
        return "sdpa", "requested with --attention-backend sdpa"
    if impl == "transformer_engine":
        if backend == "local":
            return "megatron", "requested with --attention-backend local"
        return "transformer_engine", (
            f"Transformer Engine's attention (--attention-backend {backend})")
    if backend in ("local", "unfused"):
        return "megatron", f"requested with --attention-backend {backend}"
    if backend in ("flash", "fused"):
        return "sdpa", (f"--attention-backend {backend} without Transformer Engine: PyTorch's "
                        "SDPA, which has the FlashAttention and memory-efficient kernels")
    return "sdpa", "no Transformer Engine: PyTorch's SDPA (FlashAttention on GPUs)"


def core_attention(model: "ModelConfig") -> tuple:
    """(``sdpa``, ``megatron`` or ``transformer_engine``, why): the core attention the
    model is built with, for --attention-backend, the implementation and the device."""
    return resolve_attention_backend(model.attention_backend,
                                     resolve_transformer_impl(model.transformer_impl)[0])


@dataclass(kw_only=True)
class ModelConfig:
    """A GPT as megatron-core builds it from Megatron-LM's flags. The defaults are the Llama
    form (RMSNorm, SwiGLU, RoPE, no linear biases, untied embeddings); GPT-2 (LayerNorm,
    GeLU, learned positions, biases, tied embeddings), Qwen3 (query/key norms) and
    Mixtral (mixture of experts) forms are the same flags set otherwise."""

    model_preset: Optional[str] = field(default=None, metadata=option(
        "--model-preset", "tiny, 170m, 1b, 3b (Llama), gpt2-tiny, qwen3-tiny or mixtral-tiny: a "
        "bundle of the architecture flags (docs/megatron_lm_flags.md lists them); explicit "
        "flags override it"))
    num_layers: int = field(default=4, metadata=option(
        "--num-layers", "Transformer layers L", min=1))
    hidden_size: int = field(default=64, metadata=option("--hidden-size", "hidden size", min=1))
    num_attention_heads: int = field(default=4, metadata=option(
        "--num-attention-heads", "attention heads", min=1))
    num_query_groups: Optional[int] = field(default=None, metadata=option(
        "--num-query-groups", "key/value groups (grouped-query attention); default = heads", min=1))
    ffn_hidden_size: Optional[int] = field(default=None, metadata=option(
        "--ffn-hidden-size", "SwiGLU inner size; default 8/3 hidden rounded up to 256", min=1))
    seq_length: int = field(default=128, metadata=option(
        "--seq-length", "training sequence length", min=2))
    max_position_embeddings: Optional[int] = field(default=None, metadata=option(
        "--max-position-embeddings", "longest sequence the model serves; default seq length",
        min=1))
    vocab_size: Optional[int] = field(default=None, metadata=option(
        "--vocab-size", "vocabulary size; default the tokenizer's", min=1))
    make_vocab_size_divisible_by: int = field(default=128, metadata=option(
        "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this, whatever "
        "the TP size (Megatron-LM multiplies by TP; here the model does not depend on the "
        "layout), so TP must divide it", min=1))
    padded_vocab: Optional[int] = field(default=None, metadata={
        "cli": False, "min": 1, "help": "embedding rows as built: resolved before any work "
        "(config.resolve; a loaded checkpoint's own when resuming) and saved in run_config.yaml"})
    rotary_base: int = field(default=10000, metadata=option("--rotary-base", "RoPE base", gt=0))
    norm_epsilon: float = field(default=1e-5, metadata=option(
        "--norm-epsilon", "RMSNorm epsilon", gt=0))
    init_method_std: float = field(default=0.02, metadata=option(
        "--init-method-std", "std of the normal weight init", gt=0))
    hidden_dropout: float = field(default=0.0, metadata=option(
        "--hidden-dropout", "dropout", min=0, lt=1))
    attention_dropout: float = field(default=0.0, metadata=option(
        "--attention-dropout", "attention dropout", min=0, lt=1))
    swiglu: bool = field(default=True, metadata=option(
        "--swiglu", "SwiGLU MLP (Megatron-LM's default without it: a GeLU MLP, 4x hidden)",
        const=True))
    normalization: str = field(default="RMSNorm", metadata=option(
        "--normalization", "RMSNorm or LayerNorm (Megatron-LM's default)",
        choices=("LayerNorm", "RMSNorm")))
    position_embedding_type: str = field(default="rope", metadata=option(
        "--position-embedding-type", "rope or learned_absolute (Megatron-LM's default); the "
        "others are not supported yet", choices=("learned_absolute", "rope", "mrope", "relative",
                                                 "none"),
        switches={"--use-rotary-position-embeddings": "rope"}))
    untie_embeddings_and_output_weights: bool = field(default=True, metadata=option(
        "--untie-embeddings-and-output-weights", "a separate output layer (Megatron-LM's "
        "default without it: the output layer is the embedding, tied)", const=True))
    add_bias_linear: bool = field(default=False, metadata=option(
        "--disable-bias-linear", "no biases in the linear layers (Megatron-LM's default "
        "without it: biases)", const=False))
    add_qkv_bias: bool = field(default=False, metadata=option(
        "--add-qkv-bias", "a bias in the query/key/value projection only (Qwen2 style)",
        const=True))
    qk_layernorm: bool = field(default=False, metadata=option(
        "--qk-layernorm", "normalise queries and keys per head (Qwen3 style), with "
        "--normalization's norm", const=True))
    group_query_attention: bool = field(default=True, metadata=option(
        "--group-query-attention", "use --num-query-groups (as in Megatron-LM, without this "
        "flag the attention has one group per head)", const=True))
    kv_channels: Optional[int] = field(default=None, metadata=option(
        "--kv-channels", "head dim; only hidden size / heads (the default) is supported", min=1))
    rotary_percent: float = field(default=1.0, metadata=option(
        "--rotary-percent", "share of the head dim RoPE rotates; only 1.0 is supported",
        gt=0, max=1))
    attention_backend: str = field(default="auto", metadata=option(
        "--attention-backend", "auto (Transformer Engine's choice with TE; without it SDPA on "
        "every device), sdpa (PyTorch's "
        "scaled_dot_product_attention), local or unfused (megatron-core's own), flash or "
        "fused (TE's kernels; SDPA without TE)", choices=ATTENTION_BACKENDS))
    attention_softmax_in_fp32: bool = field(default=True, metadata=option(
        "--attention-softmax-in-fp32", "attention softmax in fp32 under bf16/fp16 (Megatron-LM's "
        "default without it: in the training dtype)", const=True))
    bf16: bool = field(default=False, metadata=option("--bf16", "bf16 params and activations"))
    fp16: bool = field(default=False, metadata=option("--fp16", "fp16 with dynamic loss scaling"))
    transformer_impl: str = field(default="auto", metadata=option(
        "--transformer-impl", "auto (Transformer Engine when it imports, else local), "
        "transformer_engine or local (torch)"))
    num_experts: Optional[int] = field(default=None, metadata=option(
        "--num-experts", "mixture-of-experts MLP with this many experts in every layer "
        "(megatron-core's MoE layer; JREG measures the whole layer around it)", min=1))
    moe_router_topk: int = field(default=2, metadata=option(
        "--moe-router-topk", "experts per token", min=1))
    moe_aux_loss_coeff: float = field(default=0.0, metadata=option(
        "--moe-aux-loss-coeff", "load-balancing loss coefficient", min=0))
    moe_router_load_balancing_type: str = field(default="aux_loss", metadata=option(
        "--moe-router-load-balancing-type", "aux_loss, seq_aux_loss, sinkhorn (takes no "
        "--moe-aux-loss-coeff) or none", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none")))
    moe_router_pre_softmax: bool = field(default=False, metadata=option(
        "--moe-router-pre-softmax", "softmax over all experts before the top-k choice (default: "
        "over the chosen k after it); needed at --moe-router-topk 1", const=True))
    moe_ffn_hidden_size: Optional[int] = field(default=None, metadata=option(
        "--moe-ffn-hidden-size", "each expert's MLP inner size; default --ffn-hidden-size", min=1))
    moe_token_dispatcher_type: str = field(default="allgather", metadata=option(
        "--moe-token-dispatcher-type", "allgather or alltoall (same math)",
        choices=("allgather", "alltoall")))
    moe_grouped_gemm: bool = field(default=False, metadata=option(
        "--moe-grouped-gemm", "the experts as one grouped GEMM (Transformer Engine); the local "
        "implementation runs them one by one, the same math", const=True))

    def __post_init__(self):
        config_values.check_fields(self)  # the metadata's bounds, however the config is built
        if self.model_preset is not None:
            if self.model_preset not in PRESETS:
                raise ConfigError(
                    f"--model-preset {self.model_preset!r}: choose one of {sorted(PRESETS)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; pick heads that divide the hidden size")
        groups = self.query_groups
        if self.num_attention_heads % groups:
            raise ConfigError(
                f"--num-query-groups {groups} must divide --num-attention-heads "
                f"{self.num_attention_heads}")
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 are exclusive; pass one")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ConfigError(f"--transformer-impl {self.transformer_impl!r}: choose one of "
                             f"{', '.join(TRANSFORMER_IMPLS)}")
        if self.num_experts is not None:
            check_experts(self)
        self._check_architecture()
        if (self.max_position_embeddings is not None
                and self.max_position_embeddings < self.seq_length):
            raise ConfigError(
                f"--max-position-embeddings {self.max_position_embeddings} is below --seq-length "
                f"{self.seq_length}")

    def _check_architecture(self) -> None:
        """Refuse, in one line naming the flags, every part of a model JREG cannot build
        yet: the trainer never builds another model than the flags describe."""
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ConfigError(
                f"--position-embedding-type {self.position_embedding_type}: not supported yet; "
                "pass rope or learned_absolute")
        if self.rotary_percent != 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent}: not supported yet (RoPE "
                             "rotates the whole head); pass --rotary-percent 1.0")
        check_head_size(self)  # --kv-channels, and an even head size under RoPE
        if self.attention_backend == "local" and self.transformer_impl == "transformer_engine":
            raise ConfigError("--attention-backend local needs --transformer-impl local "
                             "(as in Megatron-LM)")

    @classmethod
    def from_preset(cls, preset: str, **overrides) -> "ModelConfig":
        if preset not in PRESETS:
            raise ConfigError(f"--model-preset {preset!r}: choose one of {sorted(PRESETS)}")
        return cls(model_preset=preset, **{**PRESETS[preset], **overrides})

    @classmethod
    def from_values(cls, values: dict) -> "ModelConfig":
        """The model of some settings as given (flags over YAML): a preset's bundle under
        them, else Megatron-LM's defaults under a Megatron-LM sizing (see SIZING)."""
        values = dict(values)
        preset = values.pop("model_preset", None)
        if preset:
            return cls.from_preset(preset, **values)
        if any(name in values for name in SIZING):
            defaults = dict(MEGATRON_LM_MODEL_DEFAULTS)
            if values.get("swiglu", defaults["swiglu"]):  # Megatron-LM's FFN size for SwiGLU
                hidden = values.get("hidden_size", cls.__dataclass_fields__["hidden_size"].default)
                defaults["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64
            values = {**defaults, **values}
        return cls(**values)

    @property
    def query_groups(self) -> int:
        """Key/value groups: --num-query-groups under --group-query-attention, as in
        Megatron-LM (which ignores --num-query-groups without it), else one per head."""
        if self.group_query_attention and self.num_query_groups:
            return self.num_query_groups
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """The MLP's inner size: --ffn-hidden-size, else 8/3 hidden rounded up to 256 for
        SwiGLU and Megatron-LM's 4 x hidden for a GeLU MLP."""
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if not self.swiglu:
            return 4 * self.hidden_size
        return -(-(8 * self.hidden_size // 3) // 256) * 256

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def family(self) -> str:
        """llama, gpt2, qwen3, mixtral or other (``model.families.family_of``)."""
        return family_of(self)

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self) -> int:
        """Embedding rows: ``padded_vocab`` when set (a resumed checkpoint's), else the
        vocabulary rounded up to ``make_vocab_size_divisible_by``; never a function of the
        parallel layout, so one seed gives one model under every TP/PP/DP split."""
        if self.padded_vocab is not None:
            return self.padded_vocab
        return self.padded_to_multiple()

    def padded_to_multiple(self) -> int:
        """The vocabulary rounded up to ``make_vocab_size_divisible_by`` (whatever
        ``padded_vocab`` says)."""
        if self.vocab_size is None:
            raise ConfigError("vocab size unknown: set --vocab-size or give a tokenizer")
        multiple = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // multiple) * multiple


@dataclass(kw_only=True, frozen=True)
class JregConfig:
    """The regularizer L = L_CE + lambda * sum_l w_l(alpha) Psi_l."""

    lam: float = field(default=0.0, metadata=option(
        "--jreg-lambda", "JREG strength lambda; 0 measures the displacement without a penalty",
        min=0))
    alpha: float = field(default=1.0, metadata=option(
        "--jreg-alpha", "depth weighting alpha of w_l(alpha)"))
    weighting: str = field(default="softmax", metadata=option(
        "--jreg-weighting", "softmax (default), power or final"))
    impl: str = field(default="auto", metadata=option(
        "--jreg-impl", "displacement kernel: auto, fused or torch"))

    def __post_init__(self):
        config_values.check_fields(self)
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(
                f"--jreg-weighting {self.weighting!r}: choose one of {sorted(WEIGHTINGS)}")
        if self.impl not in ("auto", "fused", "torch"):
            raise ConfigError(f"--jreg-impl {self.impl!r}: choose auto, fused or torch")


def _preset_values(preset: str) -> dict:
    """A preset's bundle read as the model flags it stands for (``schema.read_flags``, the
    command line's reading of them, without a parser)."""
    given = read_flags(ModelConfig, preset_flags(preset))
    # read as Megatron-LM reads a command line with these size flags: what the bundle
    # leaves out takes Megatron-LM's defaults (the GPT-2 bundle relies on them)
    return {**MEGATRON_LM_MODEL_DEFAULTS, **given}


# {preset: {field: value}} of every preset's bundle
PRESETS = {name: _preset_values(name) for name in PRESET_FLAGS}
