"""--gradient-accumulation-fusion as Megatron-LM has it: on where megatron-core's linear
layers found the fused weight-gradient kernel (apex's fused_weight_gradient_mlp_cuda, a
CUDA build only), off with --no-gradient-accumulation-fusion and off without the kernel
(every CPU run)."""

import importlib.util

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import layers

from megatron_jreg.distributed.setup import (initialize_distributed, initialize_model_parallel,
                                             seed_everything)
from megatron_jreg.model.builder import (fused_wgrad_available, transformer_config,
                                         use_gradient_accumulation_fusion)
from megatron_jreg.config.model import ModelConfig, ParallelConfig

MODEL = ModelConfig.from_preset("tiny", vocab_size=128)


@pytest.mark.parametrize("fused,disabled,on", [(True, False, True), (True, True, False),
                                               (False, False, False), (False, True, False)])
def test_decision(fused, disabled, on):
    assert use_gradient_accumulation_fusion(fused, disabled) is on


def test_the_probe_is_megatron_cores(monkeypatch):
    assert fused_wgrad_available() is layers._grad_accum_fusion_available
    for value in (True, False):
        monkeypatch.setattr(layers, "_grad_accum_fusion_available", value)
        assert fused_wgrad_available() is value
        assert transformer_config(MODEL, ParallelConfig()).gradient_accumulation_fusion is value
        assert not transformer_config(MODEL, ParallelConfig(),
                                      no_gradient_accumulation_fusion=True).gradient_accumulation_fusion


def test_off_without_the_kernel_as_on_this_cpu():
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None:
        pytest.skip("the fused weight-gradient kernel is installed here")
    assert not fused_wgrad_available()
    assert not transformer_config(MODEL, ParallelConfig()).gradient_accumulation_fusion


def test_megatrons_linear_refuses_the_fusion_without_the_kernel(monkeypatch):
    """Why the kernel decides under Transformer Engine too: the output layer is megatron's
    ColumnParallelLinear under every implementation."""
    initialize_distributed()
    initialize_model_parallel(MODEL, ParallelConfig())
    seed_everything(1)  # megatron initialises weights under its model-parallel RNG tracker
    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    config = transformer_config(MODEL, ParallelConfig())
    config.gradient_accumulation_fusion = True
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        tensor_parallel.ColumnParallelLinear(8, 8, config=config, init_method=torch.nn.init.zeros_,
                                             bias=False)
