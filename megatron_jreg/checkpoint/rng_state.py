"""Each rank's random state in a checkpoint, in Megatron-LM's form: the sharded object
``rng_state`` (Python's, NumPy's and torch's generators and megatron's model-parallel
streams), one entry per data-parallel rank so each rank resumes its own.

``dist_checkpoint`` saves :func:`sharded_rng_state`; ``loading`` restores it with
:func:`set_rng_state`, which also reads earlier versions' ``rng/rank_NNNNN.pt`` files and
a state saved on the other device.
"""

from __future__ import annotations

import random
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from megatron_jreg.platform.device import (
    cuda_generator_state,
    device_type,
    seeded_cuda_generator_state,
    set_cuda_generator_state,
)

SHARDED_KEY = "rng_state"  # Megatron-LM's sharded object
DEVICE_KEY = "jreg_device"  # ours, beside Megatron-LM's keys (which it ignores)
CPU_STREAMS_KEY = "jreg_cpu_rng_tracker_states"  # ours: a CPU run's own tracker streams
DATA_PARALLEL_STREAM = "data-parallel-rng"  # megatron-core's stream seeded as the CUDA generator
# an earlier version's names -> Megatron-LM's
_OLD_NAMES = {"python": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
              "tracker": "rng_tracker_states", "cuda": "cuda_rng_state", "device": DEVICE_KEY}


def rng_state() -> Dict:
    """This rank's random state under Megatron-LM's names, and the kind of device its
    tracker streams belong to. On a CPU, Megatron-LM's CUDA entries hold the CUDA form of
    the seeds (:func:`cuda_form`) and the CPU streams go under ``CPU_STREAMS_KEY``."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), DEVICE_KEY: device_type()}
    cuda = cuda_generator_state()
    if cuda is not None:
        state.update(cuda_rng_state=cuda, rng_tracker_states=tracker.get_states())
    else:
        state.update(cuda_form(getattr(tracker, "seed_of", {})))
        state[CPU_STREAMS_KEY] = tracker.get_states()
    return state


def cuda_form(seed_of: Dict[str, int]) -> Dict:
    """Megatron-LM's CUDA entries for streams seeded with ``seed_of`` (name -> seed) and never
    drawn from on a GPU: each stream's and the CUDA generator's state as
    ``torch.cuda.manual_seed`` leaves it (megatron-core seeds the generator with the
    data-parallel stream's seed). Without that stream the generator's entry is empty, as a
    CPU save's was before."""
    seed = seed_of.get(DATA_PARALLEL_STREAM)
    return {"cuda_rng_state": (seeded_cuda_generator_state(seed) if seed is not None
                               else torch.empty(0, dtype=torch.uint8)),
            "rng_tracker_states": {name: seeded_cuda_generator_state(value)
                                   for name, value in seed_of.items()}}


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


def _cuda_streams(state: Dict) -> bool:
    """Whether a saved state's Megatron-LM entries are CUDA generator states (Philox's 16
    bytes), as a GPU sets them."""
    streams = state.get("rng_tracker_states") or {}
    cuda = state.get("cuda_rng_state")
    return (bool(streams) and torch.is_tensor(cuda) and cuda.numel() == 16
            and all(torch.is_tensor(s) and s.numel() == 16 for s in streams.values()))


def set_rng_state(state: Dict, report: Callable[[str], None],
                  source: str = "the checkpoint") -> None:
    """Restore :func:`rng_state`'s ``state`` (or an earlier version's); ``report`` says once
    when the device streams are not the ones the saving run drew from."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    saved_on, here = saved_device(state), device_type()
    state = _megatron_names(state)
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    tracker = get_cuda_rng_tracker()
    if saved_on == here:
        tracker.set_states(state.get(CPU_STREAMS_KEY, state["rng_tracker_states"])
                           if here == "cpu" else state["rng_tracker_states"])
        cuda = state.get("cuda_rng_state")
        if here == "cuda" and torch.is_tensor(cuda) and cuda.numel():
            set_cuda_generator_state(cuda)
        return
    if here == "cuda" and _cuda_streams(state):
        # a CPU save: the CUDA form of its seeds, as Megatron-LM would set them
        tracker.set_states(state["rng_tracker_states"])
        set_cuda_generator_state(state["cuda_rng_state"])
        report(f"model-parallel random streams start from the saved seeds: {source} was saved "
               f"on cpu, whose streams a GPU cannot continue")
        return
    report(f"model-parallel random streams not restored: {source} was saved on {saved_on}, "
           f"this run is on {here} (its generators differ); they start from --seed")


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
            dist.all_gather_object(
                data, own, group=ps.get_data_parallel_group(with_context_parallel=True))
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
