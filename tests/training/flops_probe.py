"""Counts the FLOPs of one forward+backward of the tiny model with torch's FlopCounterMode
and prints them beside the trainer's TFLOP/s formula. Run by test_model_flops.py."""

import json

import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model.builder import build_model, causal_attention_mask, transformer_config
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.training.metrics import model_flops_per_token

B, S, V = 2, 48, 256  # batch, sequence, vocabulary
initialize_distributed()
# megatron's unfused attention: its score and context matmuls are aten matmuls the counter
# sees in forward and backward (it has no formula for PyTorch's CPU flash attention kernel)
cfg = ModelConfig.from_preset("tiny", vocab_size=V, seq_length=S, attention_backend="local")
par = ParallelConfig()
initialize_model_parallel(cfg, par)
seed_everything(1)
config = transformer_config(cfg, par)
tracker = JregTracker(JregConfig(lam=0.0), cfg.num_layers)
[model] = build_model(cfg, par, tracker, config)
tokens = torch.randint(0, V, (B, S))
pos = torch.arange(S).expand(B, S)
with FlopCounterMode(display=False) as counter:
    loss = model(tokens, pos, causal_attention_mask(S), labels=tokens).sum()
    loss.backward()
print(json.dumps({"counted": counter.get_total_flops(),
                  "formula": model_flops_per_token(cfg, cfg.padded_vocab_size()) * B * S}))
