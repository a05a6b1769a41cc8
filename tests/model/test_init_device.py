"""The layout-invariant init draws every weight on the CPU, whatever the parameters'
device: CUDA's generator (Philox, its element order set by the GPU's SM count) would start a
GPU run from other weights than the CPU run of the same seed. A spy on torch.Generator sees
each generator the init creates; the weights equal a draw written here from the rule
(normal(0, std) from a CPU generator per logical weight, std / sqrt(2 L) for the output
projections)."""

import math

import torch

from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model import init
from megatron_jreg.model.builder import build_model, transformer_config


def test_every_weight_is_drawn_on_the_cpu(monkeypatch):
    model = ModelConfig.from_preset("tiny", vocab_size=128, num_layers=2)
    parallel = ParallelConfig()
    initialize_distributed()
    initialize_model_parallel(model, parallel)
    seed_everything(3)
    chunks = build_model(model, parallel, None, transformer_config(model, parallel))
    devices = []
    real = torch.Generator

    def spy(*args, **kwargs):
        devices.append(str(kwargs.get("device", args[0] if args else "cpu")))
        return real(*args, **kwargs)

    monkeypatch.setattr(init.torch, "Generator", spy)
    count = init.layout_invariant_init(chunks, 11, 0.02, model.num_layers)
    assert count > 0 and devices == ["cpu"] * count
    params = dict(chunks[0].named_parameters())
    proj = params["decoder.layers.1.self_attention.linear_proj.weight"]
    # layer 2's attention output projection: its logical key and layer offset, drawn here
    gen = real().manual_seed(init._generator_seed(
        11, "decoder.layers.self_attention.linear_proj.weight", (1,)))
    expected = torch.empty(proj.shape).normal_(0.0, 0.02 / math.sqrt(2 * 2), generator=gen)
    assert torch.equal(proj.detach(), expected)
