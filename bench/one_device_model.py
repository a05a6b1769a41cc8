"""A JREG model on one device, built as the trainer builds it, and a random batch: shared
by the benchmarks that time training steps (jreg_overhead.py, gpu_model_step.py)."""

from __future__ import annotations

import atexit
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _close() -> None:
    """megatron's groups (gloo ones included) and the default group, torn down before the
    interpreter exits, as the trainer does: a gloo group's threads left to the interpreter's
    exit may abort it ("terminate called without an active exception") after its result."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def start(device: str):
    """A world of one on ``device`` ("cpu" or "cuda"); returns the torch.device."""
    if device == "cpu":
        os.environ["MEGATRON_JREG_DEVICE"] = "cpu"
    import torch

    from megatron_jreg.distributed.setup import initialize_distributed

    initialize_distributed()
    atexit.register(_close)
    return torch.device("cuda",
                        torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")


def build(model_cfg, parallel, tracker, device, *, float16_module=False,
          distributed_optimizer=False):
    """(TransformerConfig, DDP-wrapped model chunks) on ``device``, seed 1234.

    The trainer's own calls (megatron_jreg.training.trainer): the package's process groups
    (``initialize_model_parallel``), model and DDP wrap (``data_parallel.wrap``)."""
    from types import SimpleNamespace

    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from megatron_jreg.config.run import OptimConfig
    from megatron_jreg.distributed.setup import initialize_model_parallel, seed_everything
    from megatron_jreg.model.builder import build_model, transformer_config
    from megatron_jreg.training import data_parallel

    initialize_model_parallel(model_cfg, parallel)
    seed_everything(1234)
    config = transformer_config(model_cfg, parallel)
    chunks = build_model(model_cfg, parallel, tracker, config)
    for chunk in chunks:
        chunk.to(device)
    if float16_module:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    # wrap reads the experiment's model, parallel and optim sections
    experiment = SimpleNamespace(model=model_cfg, parallel=parallel,
                                 optim=OptimConfig(use_distributed_optimizer=distributed_optimizer))
    chunks = data_parallel.wrap(chunks, config, experiment)
    config.finalize_model_grads_func = finalize_model_grads
    return config, chunks


def random_batch(vocab: int, micro_batch: int, seq: int, device) -> dict:
    """One micro-batch of random tokens (fixed seed), every token counted."""
    import torch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous().to(device),
        "labels": tokens[:, 1:].contiguous().to(device),
        "loss_mask": torch.ones(micro_batch, seq, device=device),
        "position_ids": torch.arange(seq, device=device).expand(micro_batch, seq).contiguous(),
    }
