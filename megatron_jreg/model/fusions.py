"""megatron-core's fused kernels a run uses (RoPE, gradient-accumulation fusion): each on where
what it needs is installed, as Megatron-LM has them on by default, and each with the reason the
start-up line gives. ``model.builder`` calls :func:`decide`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from megatron_jreg.config.megatron_lm import MegatronLMConfig
from megatron_jreg.config.model import ModelConfig, resolve_transformer_impl

APEX_KERNEL = "apex's fused_weight_gradient_mlp_cuda"


def fused_rope_available() -> bool:
    """Whether megatron-core found Transformer Engine's fused RoPE (its own probe, made when
    ``rope_utils`` is imported)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


def fused_wgrad_available() -> bool:
    """Whether megatron-core's linear layers found apex's fused weight-gradient kernel
    (``fused_weight_gradient_mlp_cuda``, built only with CUDA): megatron's own probe, made
    when ``megatron.core.tensor_parallel.layers`` is imported."""
    from megatron.core.tensor_parallel import layers

    return layers._grad_accum_fusion_available


@dataclass(frozen=True)
class Fusions:
    """The fusions a model is built with, and why each is on or off."""

    rope: bool
    rope_why: str
    wgrad_layers: bool  # the decoder layers' linears
    wgrad_output: bool  # megatron-core's output layer: the model's TransformerConfig value
    wgrad_why: str

    def lines(self) -> List[str]:
        """The start-up lines, one per fusion."""
        wgrad = ("on" if self.wgrad_layers and self.wgrad_output
                 else "on in the layers" if self.wgrad_layers else "off")
        return [f"rope fusion: {'on' if self.rope else 'off'} ({self.rope_why})",
                f"gradient-accumulation fusion: {wgrad} ({self.wgrad_why})"]


# megatron-core's fused RoPE is Transformer Engine's kernel (rope_utils.fused_apply_rotary_pos_emb,
# None without TE; TransformerConfig refuses the setting then): on where TE builds the layers
# (the local implementation is the run without TE, and TE's kernel is CUDA only).
def _rope(model: ModelConfig, impl: str, disabled: bool) -> tuple:
    if model.position_embedding_type != "rope":
        return False, f"no RoPE: --position-embedding-type {model.position_embedding_type}"
    if disabled:
        return False, "--no-rope-fusion"
    if impl != "transformer_engine":
        return False, ("the fused RoPE kernel is Transformer Engine's; the local implementation "
                       "applies RoPE in PyTorch")
    if not fused_rope_available():
        return False, ("this Transformer Engine has no fused RoPE (megatron-core needs TE >= "
                       "1.4); upgrade transformer-engine to use it")
    return True, "Transformer Engine's kernel; --no-rope-fusion turns it off"


# The weight gradient accumulated into the fp32 main_grad inside the GEMM: Transformer
# Engine's linears do it themselves (fuse_wgrad_accumulation); megatron-core's own linears
# (every linear of the local spec, and the output layer under every implementation) need apex's
# kernel and refuse the setting without it. So the decoder layers and the output layer are
# decided apart: the model's TransformerConfig holds the output layer's setting and the TE
# layers are built with a copy holding theirs (model.jreg_layer.JregTransformerLayer).
def _wgrad(impl: str, disabled: bool) -> tuple:
    if disabled:
        return False, False, "--no-gradient-accumulation-fusion"
    apex = fused_wgrad_available()
    if impl == "transformer_engine":
        if apex:
            return True, True, (f"Transformer Engine's linears, and {APEX_KERNEL} for the output "
                                "layer")
        return True, False, (f"Transformer Engine's linears fuse it themselves; the output layer, "
                             f"megatron-core's linear, needs {APEX_KERNEL}, not installed")
    if apex:
        return True, True, f"{APEX_KERNEL} for megatron-core's linears"
    return False, False, f"megatron-core's linears need {APEX_KERNEL}, not installed"


def decide(model: ModelConfig, megatron_lm: Optional[MegatronLMConfig] = None) -> Fusions:
    """The fusions for ``model`` (its --transformer-impl resolved here); ``megatron_lm``: the
    run's Megatron-LM flags (--no-rope-fusion, --no-gradient-accumulation-fusion turn them
    off), None for neither."""
    impl = resolve_transformer_impl(model.transformer_impl)[0]
    flags = megatron_lm or MegatronLMConfig()
    rope, rope_why = _rope(model, impl, flags.no_rope_fusion)
    layers, output, why = _wgrad(impl, flags.no_gradient_accumulation_fusion)
    return Fusions(rope=rope, rope_why=rope_why, wgrad_layers=layers, wgrad_output=output,
                   wgrad_why=why)
