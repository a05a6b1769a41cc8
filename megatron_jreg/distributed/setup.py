"""Process-group and model-parallel setup for CPU (gloo) and GPU (NCCL) runs alike."""

from __future__ import annotations

import os
import random
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.errors import ConfigError
from megatron_jreg.platform import cpu as cpu_platform
from megatron_jreg.platform import mcore_fixes
from megatron_jreg.platform.device import backend, use_cpu


def print_rank_0(message: str) -> None:
    """Print on global rank 0 (before the process group exists, the launcher's RANK says
    which process is; a process without a launcher is rank 0)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(message, flush=True)


def initialize_distributed(timeout_minutes: int = 30, gpu: Optional[int] = None) -> None:
    """Start the default process group (torchrun env, or a single local process).

    On CPU this activates :mod:`megatron_jreg.platform.cpu` and uses gloo; on GPU NCCL, on
    GPU ``gpu`` (a tool's ``--device cuda:N``) or else LOCAL_RANK's (setting a device
    creates its CUDA context, so no other GPU is touched first).
    """
    mcore_fixes.apply()
    cpu = use_cpu()
    if cpu:
        cpu_platform.activate()
    if dist.is_initialized():
        return
    if not cpu:
        torch.cuda.set_device(gpu if gpu is not None else int(os.environ.get("LOCAL_RANK", "0")))
    timeout = timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:
        # plain `python -m ...`: a world of one, on an in-process store. No port is opened and
        # no launcher variable is written, so a later torchrun child of this process (or a
        # second world of one) never inherits a MASTER_PORT that this process still holds.
        dist.init_process_group(backend=backend(), store=dist.HashStore(),
                                rank=0, world_size=1, timeout=timeout)
        return
    dist.init_process_group(backend=backend(), timeout=timeout)


_LAYOUT: Optional[tuple] = None  # (layout, default group) megatron's groups were last made for


def initialize_model_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """megatron's TP/PP/CP/DP groups; raises if the world does not fit the split.

    megatron's gloo groups are created on every device, as Megatron-LM does by default:
    the optimizer (``get_megatron_optimizer``'s ``use_gloo_process_groups``) and the
    distributed optimizer's checkpoint state ask for them on GPUs too."""
    world = dist.get_world_size()
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    if world % (tp * pp * cp):
        raise ConfigError(
            f"world size {world} is not divisible by TP {tp} x PP {pp} x CP {cp}; launch a "
            f"multiple of {tp * pp * cp} processes")
    layout = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                  context_parallel_size=cp,
                  hierarchical_context_parallel_sizes=parallel.hierarchical_context_parallel_sizes,
                  virtual_pipeline_model_parallel_size=parallel.virtual_stages(model.num_layers),
                  expert_model_parallel_size=parallel.expert_model_parallel_size)
    global _LAYOUT
    world_group = dist.group.WORLD
    if parallel_state.model_parallel_is_initialized():
        if _LAYOUT == (layout, world_group):
            # the same groups (eval_jump over a run's checkpoints): megatron's destroy drops
            # its NCCL groups without freeing them, so each new set would hold GPU memory
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(**layout, create_gloo_process_groups=True)
    _LAYOUT = (layout, world_group)


def teardown() -> None:
    """megatron's groups (gloo ones included), then the default group, while the
    interpreter is alive: groups left to its exit may abort it in their threads' teardown
    ("terminate called without an active exception") after the work is done."""
    global _LAYOUT
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _LAYOUT = None
    if dist.is_initialized():
        dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Init RNG (same on every rank) plus megatron's model-parallel RNG streams."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
