"""Model families: which one a ModelConfig's architecture is (the Hugging Face class it
exports to), and the mixture-of-experts flag checks. Imports only the presets' data: the
model config uses it."""

from __future__ import annotations

from megatron_jreg.config.presets import preset_flags
from megatron_jreg.errors import ConfigError


def family_of(model) -> str:
    """llama, gpt2, qwen3 or mixtral: the Hugging Face family the architecture of ``model``
    (a ModelConfig) maps to, or "other" for a mix no family has (docs/families.md)."""
    # tied or untied embeddings alike (SmolLM2, Llama 3.2 1B and Qwen3 0.6B tie them)
    llama = (model.swiglu and model.normalization == "RMSNorm"
             and model.position_embedding_type == "rope" and not model.add_bias_linear)
    if llama and not model.add_qkv_bias:
        if model.num_experts:  # Mixtral's router: softmax over the chosen experts
            mixtral = not model.qk_layernorm and not model.moe_router_pre_softmax
            return "mixtral" if mixtral else "other"
        return "qwen3" if model.qk_layernorm else "llama"
    # GPT-2 ties them by default; GPT2LMHeadModel holds a separate lm_head when its config
    # says tie_word_embeddings: false, so an untied GPT-2 form is GPT-2 too
    gpt2 = (not model.swiglu and model.normalization == "LayerNorm"
            and model.position_embedding_type == "learned_absolute" and model.add_bias_linear
            and not model.qk_layernorm
            and not model.num_experts and model.query_groups == model.num_attention_heads)
    return "gpt2" if gpt2 else "other"


def check_experts(model) -> None:
    """The mixture-of-experts flags of a model with --num-experts; ValueError naming the flag."""
    if model.num_experts < 1:
        raise ConfigError(f"--num-experts must be >= 1, got {model.num_experts}")
    if not 1 <= model.moe_router_topk <= model.num_experts:
        raise ConfigError(f"--moe-router-topk {model.moe_router_topk} must be between 1 and "
                         f"--num-experts {model.num_experts}")
    if model.moe_aux_loss_coeff < 0:
        raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {model.moe_aux_loss_coeff}")
    sinkhorn = model.moe_router_load_balancing_type == "sinkhorn"
    # megatron-core's rules (TransformerConfig.__post_init__, TopKRouter.sinkhorn_load_balancing)
    if model.moe_router_topk == 1 and not model.moe_router_pre_softmax and not sinkhorn:
        raise ConfigError("--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over "
                         "the one chosen expert has no gradient, as in Megatron-LM); add it")
    if sinkhorn and model.moe_aux_loss_coeff > 0:
        preset = model.model_preset
        source = (f" (--model-preset {preset} sets it)" if preset
                  and "--moe-aux-loss-coeff" in preset_flags(preset) else "")
        raise ConfigError(f"--moe-router-load-balancing-type sinkhorn takes no load-balancing "
                         f"loss, but --moe-aux-loss-coeff is {model.moe_aux_loss_coeff}{source}; "
                         "pass --moe-aux-loss-coeff 0")
