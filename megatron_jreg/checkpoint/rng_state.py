"""Each rank's random state in a checkpoint, in Megatron-LM's form: the sharded object
``rng_state`` (one shard per pipeline x tensor rank, replicated over data-parallel ranks)
holding a list of dicts with Python's, NumPy's and torch's CPU generators, the CUDA
generator and megatron's model-parallel streams (the RNG tracker: dropout and init under
tensor parallelism). Megatron-LM's list holds one entry (data-parallel rank 0's); ours holds
every data-parallel rank's, so each rank resumes its own (Megatron-LM reads entry 0, as it
does for its own saves). Checkpoints of earlier versions kept one file per rank
(``rng/rank_NNNNN.pt``, other key names): :func:`set_rng_state` reads those too.

The tracker's streams are generator states of the device that saved them (mt19937 on a
CPU, Philox on a GPU), so a resume on the other kind of device keeps the streams this run
seeded from ``--seed`` and says so; the host generators are restored either way.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron_jreg.platform.device import (
    cuda_generator_state,
    device_type,
    set_cuda_generator_state,
)

SHARDED_KEY = "rng_state"  # Megatron-LM's sharded object
DEVICE_KEY = "jreg_device"  # ours, beside Megatron-LM's keys (which it ignores)
# an earlier version's names -> Megatron-LM's
_OLD_NAMES = {"python": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
              "tracker": "rng_tracker_states", "cuda": "cuda_rng_state", "device": DEVICE_KEY}


def rng_state() -> Dict:
    """This rank's random state under Megatron-LM's names, and the kind of device its
    tracker streams belong to. Without CUDA the CUDA generator's entry is an empty tensor
    (``torch.cuda.set_rng_state`` queues it and never runs it there)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    cuda = cuda_generator_state()
    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": cuda if cuda is not None else torch.empty(0, dtype=torch.uint8),
            "rng_tracker_states": get_cuda_rng_tracker().get_states(), DEVICE_KEY: device_type()}


def _megatron_names(state: Dict) -> Dict:
    return {_OLD_NAMES.get(k, k): v for k, v in state.items()}


def saved_device(state: Dict) -> str:
    """The kind of device whose generators a saved state's tracker streams are: recorded by
    us (or, in an earlier version's file without the record, told by its CUDA entry), or
    (Megatron-LM records none) told by their size: a CPU generator's state is mt19937's
    5056 bytes, a CUDA generator's Philox state 16."""
    if "python" in state and "device" not in state:
        # an earlier version's file from before it recorded the device: a GPU run's has "cuda"
        return "cuda" if "cuda" in state else "cpu"
    state = _megatron_names(state)
    if DEVICE_KEY in state:
        return state[DEVICE_KEY]
    cpu_size = torch.get_rng_state().numel()
    streams = [s for s in (state.get("rng_tracker_states") or {}).values() if torch.is_tensor(s)]
    if streams:
        return "cpu" if all(s.numel() == cpu_size for s in streams) else "cuda"
    cuda = state.get("cuda_rng_state")
    return "cuda" if torch.is_tensor(cuda) and cuda.numel() else "cpu"


def set_rng_state(state: Dict, report: Callable[[str], None], source: str = "the checkpoint") -> None:
    """Restore :func:`rng_state`'s ``state`` (or an earlier version's); ``report`` says once
    when the device streams are kept (saved on another kind of device)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    saved_on, here = saved_device(state), device_type()
    state = _megatron_names(state)
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if saved_on != here:
        report(f"model-parallel random streams not restored: {source} was saved on {saved_on}, "
               f"this run is on {here} (its generators differ); they start from --seed")
        return
    get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    cuda = state.get("cuda_rng_state")
    if torch.is_tensor(cuda) and cuda.numel():
        set_cuda_generator_state(cuda)


def _layout() -> Tuple[Tuple[int, ...], Tuple[int, ...], int, int]:
    """(shard grid, this rank's shard, replica id, data-parallel size) of Megatron-LM's
    ``rng_state``: (PP, TP) replicated over data-parallel ranks, or (PP, TP, DP) with
    expert parallelism."""
    from megatron.core import parallel_state as ps

    pp, tp = ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()
    pp_rank, tp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    if ps.get_expert_model_parallel_world_size() > 1:
        return (pp, tp, dp), (pp_rank, tp_rank, dp_rank), 0, dp
    return (pp, tp), (pp_rank, tp_rank), dp_rank, dp


def sharded_rng_state(loading: bool = False):
    """Megatron-LM's ``rng_state`` sharded object of this rank: to save (every data-parallel
    rank's state gathered, collective) or, with ``loading``, to load into."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    shape, offset, replica, dp = _layout()
    data: Optional[List[Dict]] = None
    if not loading:
        own = rng_state()
        if len(shape) == 3 or dp == 1:
            data = [own]
        else:
            data = [None] * dp
            dist.all_gather_object(data, own, group=ps.get_data_parallel_group(with_context_parallel=True))
    return ShardedObject(SHARDED_KEY, data, shape, offset, replica_id=replica)


def saved_grid(keys) -> Optional[Tuple[int, ...]]:
    """The shard grid of the checkpoint's ``rng_state`` (from its saved keys, megatron-core's
    ``rng_state/shard_OFFSET_SHAPE``), or None when it holds none."""
    for key in keys:
        head, _, shard = key.partition("/shard_")
        if head == SHARDED_KEY and shard.count("_") == 1:
            offset, shape = shard.split("_")
            dims = tuple(int(d) for d in shape.split("."))
            # megatron-core's rule for keys that left the last dimension out
            return dims + (-1,) if len(dims) + 1 == len(offset.split(".")) else dims
    return None


def grid_here() -> Tuple[int, ...]:
    return _layout()[0]


def own_entry(loaded: List[Dict]) -> Dict:
    """This rank's state from a loaded ``rng_state`` list: its data-parallel rank's where
    every rank's was saved, else the one entry (Megatron-LM's: data-parallel rank 0's)."""
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    dp = ps.get_data_parallel_world_size(with_context_parallel=True)
    return loaded[dp_rank] if len(loaded) == dp else loaded[0]
