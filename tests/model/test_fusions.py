"""The fusions a model is built with (megatron_jreg/model/fusions.py), on where what they need
is installed, and the --recompute-modules layernorm line. Every arm is taken here on the CPU:
the GPU ones by setting what megatron-core's own probes found (Transformer Engine, its fused
RoPE, apex's fused weight-gradient kernel), and the model is built and run with the
decisions those arms give."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.tensor_parallel import layers

from megatron_jreg.config import megatron_lm
from megatron_jreg.config import model as config_model
from megatron_jreg.config.megatron_lm import MegatronLMConfig
from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.config.run import TrainingConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model import fusions
from megatron_jreg.model.builder import build_model, causal_attention_mask, transformer_config
from megatron_jreg.model.init import layout_invariant_init

MODEL = ModelConfig.from_preset("tiny", vocab_size=128)
TE = ModelConfig.from_preset("tiny", vocab_size=128, transformer_impl="transformer_engine")
LOCAL = ModelConfig.from_preset("tiny", vocab_size=128, transformer_impl="local")
OFF = MegatronLMConfig(no_rope_fusion=True, no_gradient_accumulation_fusion=True)
ROPE_CALLS = []


def te_fused_rope(t, freqs, interleaved=False):
    """Stands for Transformer Engine's fused RoPE: records the call, computes megatron's own."""
    ROPE_CALLS.append(tuple(t.shape))
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


@pytest.fixture
def installed(monkeypatch):
    """installed(te=, rope=, apex=): what megatron-core's probes report from then on."""
    def install(te=False, rope=False, apex=False):
        monkeypatch.setattr(config_model, "transformer_engine_available", lambda: te)
        monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb",
                            te_fused_rope if rope else None)
        monkeypatch.setattr(layers, "_grad_accum_fusion_available", apex)
    return install


# ---- RoPE fusion -------------------------------------------------------------------------

@pytest.mark.parametrize("te,rope,model,flags,on,why", [
    (True, True, TE, None, True, "Transformer Engine's kernel; --no-rope-fusion turns it off"),
    (True, True, MODEL, None, True, "Transformer Engine's kernel"),  # auto takes TE
    (True, True, TE, OFF, False, "--no-rope-fusion"),
    (True, False, TE, None, False, "this Transformer Engine has no fused RoPE (megatron-core "
     "needs TE >= 1.4)"),
    (False, False, MODEL, None, False, "the fused RoPE kernel is Transformer Engine's"),
    (True, True, LOCAL, None, False, "the fused RoPE kernel is Transformer Engine's"),
    (True, True, ModelConfig.from_preset("gpt2-tiny", vocab_size=128), None, False,
     "no RoPE: --position-embedding-type learned_absolute"),
], ids=["te", "auto-te", "no-rope-fusion", "te-without-kernel", "no-te", "local", "gpt2"])
def test_rope_fusion_decision(installed, te, rope, model, flags, on, why):
    installed(te=te, rope=rope)
    decided = fusions.decide(model, flags)
    assert decided.rope is on and why in decided.rope_why
    assert decided.lines()[0] == f"rope fusion: {'on' if on else 'off'} ({decided.rope_why})"


def test_the_rope_probe_is_megatron_cores(installed):
    assert fusions.fused_rope_available() is (rope_utils.fused_apply_rotary_pos_emb is not None)
    installed(rope=True)
    assert fusions.fused_rope_available()
    installed(rope=False)
    assert not fusions.fused_rope_available()


def test_off_without_transformer_engine_as_on_this_cpu():
    if config_model.transformer_engine_available():
        pytest.skip("Transformer Engine is installed here")
    decided = fusions.decide(MODEL)
    assert not decided.rope and not transformer_config(MODEL, ParallelConfig()).apply_rope_fusion


def _run(decided):
    """(config, model, its logits on one batch): the local implementation (megatron's own
    layers stand in for Transformer Engine's), built with ``decided``, the same weights."""
    parallel = ParallelConfig()
    initialize_distributed()
    initialize_model_parallel(LOCAL, parallel)
    seed_everything(1)
    config = transformer_config(LOCAL, parallel, decided)
    chunks = build_model(LOCAL, parallel, None, config, decided)
    layout_invariant_init(chunks, 7, 0.02, LOCAL.num_layers)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = chunks[0](tokens, torch.arange(16).expand(2, 16), causal_attention_mask(16))
    return config, chunks[0], logits


def test_the_te_arm_runs_the_fused_rope_kernel(installed):
    """With Transformer Engine's fused RoPE found, the TE arm's decision reaches megatron's
    attention: each layer rotates its queries and keys with the fused kernel (here a
    recorder of the same math), and the model computes what the unfused one does."""
    installed(te=True, rope=True)
    on = fusions.decide(TE)
    assert on.rope
    plain = fusions.Fusions(rope=False, rope_why="", wgrad_layers=False, wgrad_output=False,
                            wgrad_why="")
    ROPE_CALLS.clear()
    config, _, fused = _run(fusions.Fusions(**dict(vars(plain), rope=True)))
    assert config.apply_rope_fusion
    assert len(ROPE_CALLS) == 2 * MODEL.num_layers  # queries and keys of every layer
    ROPE_CALLS.clear()
    config, _, unfused = _run(plain)
    assert not config.apply_rope_fusion and ROPE_CALLS == []
    torch.testing.assert_close(fused, unfused, rtol=0, atol=0)


# ---- gradient-accumulation fusion ----------------------------------------------------------

@pytest.mark.parametrize("te,apex,flags,layers_on,output_on,why", [
    (True, False, None, True, False, "Transformer Engine's linears fuse it themselves; the "
     "output layer, megatron-core's linear, needs apex's fused_weight_gradient_mlp_cuda, "
     "not installed"),
    (True, True, None, True, True, "Transformer Engine's linears, and apex's"),
    (False, True, None, True, True, "apex's fused_weight_gradient_mlp_cuda for megatron-core's "
     "linears"),
    (False, False, None, False, False, "megatron-core's linears need apex's "
     "fused_weight_gradient_mlp_cuda, not installed"),
    (True, True, OFF, False, False, "--no-gradient-accumulation-fusion"),
    (False, True, OFF, False, False, "--no-gradient-accumulation-fusion"),
], ids=["te", "te-apex", "apex", "none", "te-disabled", "apex-disabled"])
def test_wgrad_fusion_decision(installed, te, apex, flags, layers_on, output_on, why):
    installed(te=te, apex=apex)
    decided = fusions.decide(MODEL, flags)
    assert (decided.wgrad_layers, decided.wgrad_output) == (layers_on, output_on)
    assert why in decided.wgrad_why
    state = "on" if layers_on and output_on else "on in the layers" if layers_on else "off"
    assert decided.lines()[1] == f"gradient-accumulation fusion: {state} ({decided.wgrad_why})"


def test_the_wgrad_probe_is_megatron_cores(monkeypatch):
    assert fusions.fused_wgrad_available() is layers._grad_accum_fusion_available
    for value in (True, False):
        monkeypatch.setattr(layers, "_grad_accum_fusion_available", value)
        assert fusions.fused_wgrad_available() is value


def test_the_te_arm_builds_fused_layers_and_an_unfused_output_layer(installed):
    """The TE arm without apex: the decoder layers are built from a copy of the model's
    config that fuses (Transformer Engine's linears read it), the output layer from the
    model's, which does not (megatron's linear refuses it without apex). The layers here are
    megatron's own, accepted by setting apex found while they are built."""
    installed(te=True, apex=False)
    decided = fusions.decide(TE)
    assert decided.wgrad_layers and not decided.wgrad_output
    installed(apex=True)  # megatron's linears stand in for TE's here
    config, model, _ = _run(decided)
    assert not config.gradient_accumulation_fusion
    assert model.output_layer.gradient_accumulation_fusion is False
    for layer in model.decoder.layers:
        assert layer.config is not config and layer.config.gradient_accumulation_fusion
        linears = [m for m in layer.modules() if isinstance(
            m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear))]
        assert len(linears) == 4 and all(m.gradient_accumulation_fusion for m in linears)
    # without the decision the layers share the model's config
    [model] = build_model(LOCAL, ParallelConfig(), None, config)
    assert all(layer.config is config for layer in model.decoder.layers)


def test_megatrons_linear_refuses_the_fusion_without_the_kernel(monkeypatch):
    """Why the output layer's setting is apex's under every implementation: it is megatron's
    ColumnParallelLinear."""
    initialize_distributed()
    initialize_model_parallel(MODEL, ParallelConfig())
    seed_everything(1)  # megatron initialises weights under its model-parallel RNG tracker
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    config = transformer_config(MODEL, ParallelConfig())
    config.gradient_accumulation_fusion = True
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        tensor_parallel.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_,
                                             bias=False)


# ---- --recompute-modules layernorm ---------------------------------------------------------

def _notes(impl, modules, granularity="selective", preset="tiny"):
    """The Megatron-LM lines the trainer prints for this model and recompute setting."""
    experiment = SimpleNamespace(
        model=ModelConfig.from_preset(preset, vocab_size=128), megatron_lm=MegatronLMConfig(),
        parallel=ParallelConfig(recompute_granularity=granularity, recompute_modules=modules),
        training=TrainingConfig())
    return megatron_lm.notes(experiment, {}, impl, "nccl")


def test_layernorm_recompute_says_it_has_no_effect_under_transformer_engine():
    """megatron-core recomputes only norms that are modules of their own; Transformer
    Engine's spec fuses them into the next linear (the dense layer has none left, the MoE
    layer its pre-MLP norm)."""
    assert _notes("transformer_engine", ["core_attn", "layernorm"]) == [
        megatron_lm.LAYERNORM_RECOMPUTE]
    assert megatron_lm.LAYERNORM_RECOMPUTE.startswith("--recompute-modules layernorm: no effect")
    assert "--transformer-impl local" in megatron_lm.LAYERNORM_RECOMPUTE
    assert _notes("transformer_engine", ["layernorm"], preset="mixtral-tiny") == [
        megatron_lm.LAYERNORM_RECOMPUTE_MOE]
    # the local implementation recomputes its norms; other modules and full recompute say nothing
    assert _notes("local", ["layernorm"]) == []
    assert _notes("transformer_engine", ["core_attn", "mlp"]) == []
    assert _notes("transformer_engine", ["layernorm"], granularity="full") == []


def test_megatron_core_recomputes_the_local_norms():
    """What the line stands on: with the local spec megatron-core's layer recomputes both
    norms (each is a module of its own); a fused norm is an IdentityOp it skips."""
    parallel = ParallelConfig(recompute_granularity="selective", recompute_modules=["layernorm"])
    initialize_distributed()
    initialize_model_parallel(MODEL, parallel)
    seed_everything(1)
    [model] = build_model(MODEL, parallel, None)
    for layer in model.decoder.layers:
        assert layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm


# ---- the transformer implementation -------------------------------------------------------

def test_auto_takes_transformer_engine_where_it_imports(installed):
    installed(te=True)
    assert config_model.resolve_transformer_impl("auto") == (
        "transformer_engine", "Transformer Engine is installed")
    assert config_model.resolve_transformer_impl("transformer_engine")[0] == "transformer_engine"
    installed(te=False)
    impl, why = config_model.resolve_transformer_impl("auto")
    assert impl == "local" and "pip install transformer-engine[pytorch]" in why
    with pytest.raises(ValueError, match="needs Transformer Engine installed"):
        config_model.resolve_transformer_impl("transformer_engine")
