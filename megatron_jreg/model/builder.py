"""Build megatron-core GPTModel chunks in Llama form with JREG layers."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_jreg.model.config import ModelConfig, ParallelConfig
from megatron_jreg.model.jreg_layer import JregTracker, JregTransformerLayer


def transformer_config(model: ModelConfig, parallel: ParallelConfig) -> TransformerConfig:
    """megatron's TransformerConfig for a Llama-form model under the given split."""
    vp = parallel.virtual_stages(model.num_layers)
    dtype = torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32
    te = model.transformer_impl == "transformer_engine"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.query_groups,
        ffn_hidden_size=model.ffn_size,
        kv_channels=model.hidden_size // model.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
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
        # The local (torch) path has no fused kernels to call; TE brings its own.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=te,
        bias_dropout_fusion=te,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )


def layer_spec(model: ModelConfig, tracker: Optional[JregTracker]) -> ModuleSpec:
    """The Llama layer spec with megatron's TransformerLayer swapped for the JREG one."""
    if model.transformer_impl == "transformer_engine":
        try:
            from megatron.core.models.gpt.gpt_layer_specs import (
                get_gpt_layer_with_transformer_engine_spec,
            )
            import transformer_engine  # noqa: F401
        except ImportError as err:
            raise RuntimeError(
                "--transformer-impl transformer_engine needs Transformer Engine installed "
                f"({err}); install it or use --transformer-impl local") from err
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.module = JregTransformerLayer
    spec.params = dict(spec.params or {}, jreg_tracker=tracker)
    return spec


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    tracker: Optional[JregTracker],
    config: Optional[TransformerConfig] = None,
) -> List[GPTModel]:
    """This rank's model chunks: one GPTModel, or one per virtual stage when interleaved.

    parallel_state must already be initialised with the same TP/PP/VPP sizes.
    """
    config = config or transformer_config(model, parallel)
    vocab = model.padded_vocab_size(parallel.tensor_model_parallel_size)
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(model, tracker),
                vocab_size=vocab,
                max_sequence_length=model.max_positions,
                pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
                share_embeddings_and_output_weights=False,  # Llama: untied
                position_embedding_type="rope",
                rotary_base=model.rotary_base,
                parallel_output=True,
                vp_stage=stage,
            )
        )
    return chunks


def causal_attention_mask(seq_length: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked out (future positions)."""
    return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device), 1)[None, None]
