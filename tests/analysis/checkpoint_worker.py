"""Reference numbers of trainer checkpoints, computed the way training does.

    python checkpoint_worker.py TOKENS.pt OUT.pt CKPT [CKPT ...]

For each checkpoint (latest iteration): rebuild the model at TP1 PP1 from its
run_config.yaml with a JregTracker (lambda 0: measure only), load the weights with the
trainer's load_checkpoint, run ``forward_backward(..., forward_only=True)`` on the tokens
as one micro-batch and save the tracker's Psi_l and the model's logits. Independent of
megatron_jreg.analysis. Used by test_eval_jump_checkpoint.py and test_convert_to_hf.py.
"""

import sys

import torch

from megatron_jreg.checkpoint import formats
from megatron_jreg.checkpoint.loading import load_checkpoint
from megatron_jreg.config.model import JregConfig, ParallelConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model.builder import build_model, causal_attention_mask
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.training.step import forward_backward


def reference(root, tokens):
    source = formats.read(root)
    configs = source.format.configs
    model_cfg, parallel = configs["model"], ParallelConfig()
    initialize_model_parallel(model_cfg, parallel)
    seed_everything(configs["training"].seed)
    tracker = JregTracker(JregConfig(lam=0.0), model_cfg.num_layers)
    chunks = build_model(model_cfg, parallel, tracker)
    load_checkpoint(source, chunks)
    for chunk in chunks:
        chunk.eval()
    b, s = tokens.shape
    positions = torch.arange(s).expand(b, s).contiguous()
    batch = {
        "tokens": tokens,
        "labels": tokens,
        "loss_mask": torch.ones(b, s),
        "position_ids": positions,
    }
    with torch.no_grad():
        out = forward_backward(chunks, [batch], s, b, tracker, forward_only=True)
        logits = chunks[0](tokens, positions, causal_attention_mask(s))  # [b, s, V]
    return {"psi": out["psi"], "logits": logits.float()}


def main():
    tokens_file, out_file, *roots = sys.argv[1:]
    tokens = torch.load(tokens_file)
    initialize_distributed()
    torch.save({root: reference(root, tokens) for root in roots}, out_file)


if __name__ == "__main__":
    main()
