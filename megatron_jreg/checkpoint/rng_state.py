"""Each rank's random state in a checkpoint (``rng/rank_NNNNN.pt``): Python's, NumPy's,
torch's CPU generator, megatron's model-parallel streams (the RNG tracker: dropout and
init under tensor parallelism) and, on a GPU, the CUDA generator.

The tracker's streams are generator states of the device that saved them (mt19937 on a
CPU, Philox on a GPU), so a resume on the other kind of device keeps the streams this run
seeded from ``--seed`` and says so; the host generators are restored either way.
"""

from __future__ import annotations

import random
from typing import Callable, Dict

import numpy as np
import torch

from megatron_jreg.platform.device import (
    cuda_generator_state,
    device_type,
    set_cuda_generator_state,
)


def rng_state() -> Dict:
    """This rank's random state, and the kind of device its tracker streams belong to."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states(),
             "device": device_type()}
    cuda = cuda_generator_state()
    if cuda is not None:
        state["cuda"] = cuda
    return state


def set_rng_state(state: Dict, report: Callable[[str], None], source: str = "the checkpoint") -> None:
    """Restore :func:`rng_state`'s ``state``; ``report`` says once when the device streams
    are kept (saved on another kind of device)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    # checkpoints written before the device was recorded: a GPU run's carries "cuda"
    saved_on, here = state.get("device", "cuda" if "cuda" in state else "cpu"), device_type()
    if saved_on != here:
        report(f"model-parallel random streams not restored: {source} was saved on {saved_on}, "
               f"this run is on {here} (its generators differ); they start from --seed")
        return
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state:
        set_cuda_generator_state(state["cuda"])
