"""Each model family's export: megatron-core's model and the Hugging Face model of its family,
given the exported weights, give the same logits (1e-5 of the largest), in one process.

The megatron model is built by the trainer's own builder from the family's flags (the
flags docs/families.md gives) with random weights (biases and norms included, so a
mapping that drops or transposes one shows), and run as the trainer runs it."""

import pytest
import torch

pytest.importorskip("transformers")

from megatron_jreg.checkpoint.to_hf import HF_CLASSES, hf_config, hf_state_dict  # noqa: E402
from megatron_jreg.errors import InputError  # noqa: E402

VOCAB, SEQ = 96, 24
FAMILIES = {
    "llama": {},
    "gpt2": {"swiglu": False, "normalization": "LayerNorm",
             "position_embedding_type": "learned_absolute", "add_bias_linear": True,
             "untie_embeddings_and_output_weights": False, "group_query_attention": False,
             "ffn_hidden_size": 128, "max_position_embeddings": 32},
    "qwen3": {"qk_layernorm": True, "rotary_base": 1000000},
    "mixtral": {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
                "ffn_hidden_size": 48},
}


def _megatron_model(flags):
    from megatron_jreg.config.model import ModelConfig, ParallelConfig
    from megatron_jreg.distributed.setup import (
        initialize_distributed,
        initialize_model_parallel,
        seed_everything,
    )
    from megatron_jreg.model.builder import build_model

    cfg = ModelConfig.from_preset("tiny", vocab_size=VOCAB, seq_length=SEQ, **flags)
    parallel = ParallelConfig()
    initialize_distributed()
    initialize_model_parallel(cfg, parallel)
    seed_everything(7)
    (model,) = build_model(cfg, parallel, tracker=None)
    with torch.no_grad():  # everything random: norms and biases too
        gen = torch.Generator().manual_seed(3)
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2
                        + (1.0 if param.dim() == 1 and param.shape[0] <= 64 else 0.0))
    if not cfg.untie_embeddings_and_output_weights:
        assert model.output_layer.weight is None  # tied: the embedding is the output layer
    return cfg, model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_gives_the_same_logits(family):
    import transformers

    from megatron_jreg.model.builder import causal_attention_mask

    cfg, model = _megatron_model(FAMILIES[family])
    assert cfg.family == family
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(SEQ).expand(2, SEQ)
    with torch.no_grad():
        ours = model(tokens, positions, causal_attention_mask(SEQ)).float()  # [b, s, V]
    config = hf_config(cfg, cfg.padded_vocab_size())
    hf_model = getattr(transformers, HF_CLASSES[family])(config).eval()
    state = hf_state_dict(model.state_dict(), cfg)
    missing, unexpected = hf_model.load_state_dict(state, strict=False)
    assert not unexpected
    assert [k for k in missing if "rotary" not in k and k != "lm_head.weight"] == []
    with torch.no_grad():
        theirs = hf_model(tokens).logits.float()
    assert theirs.shape == ours.shape
    # fp32 reorderings give ~1e-6; HF's tanh GeLU in place of megatron's exact one gives 8e-5
    scale = ours.abs().max()
    assert float((theirs - ours).abs().max() / scale) < 1e-5, family


def test_an_architecture_no_family_has_is_refused_in_one_line():
    from megatron_jreg.config.model import ModelConfig

    cfg = ModelConfig.from_preset("tiny", vocab_size=VOCAB, normalization="LayerNorm")
    assert cfg.family == "other"
    with pytest.raises(InputError, match="no Hugging Face family") as err:
        hf_config(cfg, 128)
    assert "\n" not in str(err.value)
