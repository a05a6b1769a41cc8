"""Build megatron-core GPTModel chunks with JREG layers (Llama form by default; GPT-2,
Qwen3 and Mixtral forms from the same flags).

The model is the same under every layout: the vocabulary is padded independently of TP,
and the megatron-core workarounds of :mod:`megatron_jreg.platform.mcore_fixes` and the
sequence-parallel norms of :mod:`megatron_jreg.model.norm` apply on every device. The JREG
layer wraps the family's own layer spec: for a mixture-of-experts model, megatron's
TransformerLayer around its MoE layer, so Psi_l is the displacement of the whole layer.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_jreg.config.model import (
    ModelConfig,
    ParallelConfig,
    core_attention,
    resolve_transformer_impl,
)
from megatron_jreg.errors import ConfigError
from megatron_jreg.model.attention import SDPAttention
from megatron_jreg.model.fusions import Fusions
from megatron_jreg.model.fusions import decide as decide_fusions
from megatron_jreg.model.jreg_layer import JregTracker, JregTransformerLayer
from megatron_jreg.model.norm import norm_class
from megatron_jreg.platform import mcore_fixes


def _impl(model: ModelConfig) -> str:
    return resolve_transformer_impl(model.transformer_impl)[0]


def transformer_config(model: ModelConfig, parallel: ParallelConfig,
                       fusions: Optional[Fusions] = None) -> TransformerConfig:
    """megatron's TransformerConfig for the model under the given split, with ``fusions``
    (default: :func:`megatron_jreg.model.fusions.decide` without Megatron-LM's flags that
    turn them off). Its gradient-accumulation fusion is the output layer's: build the model
    with the same ``fusions`` (:func:`build_model`) for the decoder layers' own."""
    fusions = fusions or decide_fusions(model)
    vp = parallel.virtual_stages(model.num_layers)
    dtype = torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32
    te = _impl(model) == "transformer_engine"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        ffn_hidden_size=model.ffn_size,
        kv_channels=model.head_dim,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=model.swiglu,  # SwiGLU, else a GeLU MLP
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        attention_softmax_in_fp32=model.attention_softmax_in_fp32,
        # Transformer Engine's kernel choice (the local spec's attention is set in the spec)
        attention_backend=AttnBackend[model.attention_backend if te and model.attention_backend
                                      in AttnBackend.__members__ else "auto"],
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_router_pre_softmax=model.moe_router_pre_softmax,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_ffn_hidden_size=model.moe_ffn_size if model.num_experts else None,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_grouped_gemm=model.moe_grouped_gemm and te,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
        bf16=model.bf16,
        fp16=model.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=parallel.context_parallel_size,
        hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
        cp_comm_type=parallel.cp_comm_types(
            model.num_layers, core_attention(model)[0] == "transformer_engine"),
        # Interleaving sends to "next" and "prev" at once; with two stages both are the same
        # peer, and batched p2p would pair a gradient with an activation. Megatron-LM's
        # default for interleaving, separate (overlapped) p2p ops, keeps them apart.
        overlap_p2p_comm=vp is not None,
        batch_p2p_comm=vp is None,
        sequence_parallel=parallel.sequence_parallel,
        recompute_granularity=parallel.recompute_granularity,
        recompute_method=parallel.recompute_method,
        recompute_num_layers=parallel.recompute_num_layers,
        recompute_modules=parallel.recompute_modules,
        gradient_accumulation_fusion=fusions.wgrad_output,
        masked_softmax_fusion=False,
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        apply_rope_fusion=fusions.rope,
        persist_layer_norm=False,
        # Free each pipeline stage's output activations once sent (Megatron-LM's default
        # with PP); needs viewless stage outputs, which the JREG layer guarantees.
        deallocate_pipeline_outputs=True,
    )


def jreg_layer_spec(base: ModuleSpec, tracker: Optional[JregTracker],
                    wgrad_fusion: Optional[bool] = None) -> ModuleSpec:
    """``base`` (a TransformerLayer spec, dense or MoE) with its layer swapped for the JREG one.

    Refuses a layer that is not megatron's TransformerLayer (JREG measures its input and
    output); the layer's submodules, an MoE MLP included, are kept as they are.
    ``wgrad_fusion``: the layers' gradient-accumulation fusion where it is not the model's
    (:class:`megatron_jreg.model.fusions.Fusions`); None keeps the model's.
    """
    if not (isinstance(base.module, type) and issubclass(base.module, TransformerLayer)):
        raise ValueError(f"JREG wraps megatron's TransformerLayer; the spec builds {base.module!r}")
    params = dict(base.params or {}, jreg_tracker=tracker)
    if wgrad_fusion is not None:
        params["gradient_accumulation_fusion"] = wgrad_fusion
    return ModuleSpec(module=JregTransformerLayer, submodules=base.submodules, params=params)


def layer_spec(model: ModelConfig, tracker: Optional[JregTracker],
               wgrad_fusion: Optional[bool] = None) -> ModuleSpec:
    """The family's megatron layer spec with its TransformerLayer swapped for the JREG one
    (and its core attention for SDPA when --attention-backend resolves to it);
    ``wgrad_fusion`` as :func:`jreg_layer_spec` takes it."""
    sdpa = core_attention(model)[0] == "sdpa"
    if _impl(model) == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=model.moe_grouped_gemm,
            qk_layernorm=model.qk_layernorm)
        if sdpa:
            spec.submodules.self_attention.submodules.core_attention = SDPAttention
        return jreg_layer_spec(spec, tracker, wgrad_fusion)
    spec = get_gpt_layer_local_spec(num_experts=model.num_experts, moe_grouped_gemm=False,
                                    qk_layernorm=model.qk_layernorm,
                                    normalization=model.normalization)
    # megatron's local norm (WrappedTorchNorm) refuses sequence parallelism: ours does not
    norm = norm_class(model.normalization)
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    attention = spec.submodules.self_attention.submodules
    if model.qk_layernorm:
        attention.q_layernorm = norm
        attention.k_layernorm = norm
    if sdpa:
        attention.core_attention = SDPAttention
    return jreg_layer_spec(spec, tracker, wgrad_fusion)


def block_spec(model: ModelConfig, config: TransformerConfig, tracker: Optional[JregTracker],
               vp_stage: Optional[int] = None,
               wgrad_fusion: Optional[bool] = None) -> TransformerBlockSubmodules:
    """This stage's layers and final norm. Given explicitly because megatron's default final
    norm for a layer spec is Apex's FusedLayerNorm when Apex is installed (no RMSNorm) and
    WrappedTorchNorm otherwise (no sequence parallelism)."""
    if _impl(model) == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = norm_class(model.normalization)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    spec = layer_spec(model, tracker, wgrad_fusion)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=final_norm)


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    tracker: Optional[JregTracker],
    config: Optional[TransformerConfig] = None,
    fusions: Optional[Fusions] = None,
) -> List[GPTModel]:
    """This rank's model chunks: one GPTModel, or one per virtual stage when interleaved.

    parallel_state must already be initialised with the same TP/PP/VPP sizes. ``fusions``:
    those ``config`` was made with (:func:`transformer_config`), for the decoder layers'
    gradient-accumulation fusion; without them the layers take ``config``'s. Without
    ``config`` both come from :func:`megatron_jreg.model.fusions.decide`.
    """
    mcore_fixes.apply()
    if config is None:
        fusions = fusions or decide_fusions(model)
        config = transformer_config(model, parallel, fusions)
    wgrad_fusion = fusions.wgrad_layers if fusions is not None else None
    vocab = model.padded_vocab_size()
    tp = parallel.tensor_model_parallel_size
    if vocab % tp:
        raise ConfigError(f"the padded vocabulary ({vocab} rows) is not divisible by "
                         f"--tensor-model-parallel-size {tp}; pick a TP that divides it")
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block_spec(model, config, tracker, stage, wgrad_fusion),
                vocab_size=vocab,
                max_sequence_length=model.max_positions,
                pre_process=parallel_state.is_pipeline_first_stage(
                    ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(
                    ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
                position_embedding_type=model.position_embedding_type,
                rotary_base=model.rotary_base,
                parallel_output=True,
                vp_stage=stage,
            )
        )
    return chunks


def causal_attention_mask(seq_length: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked out (future positions).

    Built once per (length, device) and shared by every micro-batch: nobody may write into
    it (megatron-core's attention, Transformer Engine's and :class:`SDPAttention` only
    read it)."""
    return _causal_mask(seq_length, torch.device(device) if device is not None
                        else torch.get_default_device())


@functools.lru_cache(maxsize=8)
def _causal_mask(seq_length: int, device: torch.device) -> torch.Tensor:
    ones = torch.ones(seq_length, seq_length, dtype=torch.bool, device=device)
    return torch.triu(ones, 1)[None, None]
