"""Checkpoints in Megatron's layout with dist-checkpointing (torch_dist).

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/            dist-ckpt shards, common.pt, metadata.json
                      run_config.yaml     the resolved config of the run
                      rng/rank_00000.pt   each rank's RNG state
                      jreg_complete.json  written last: the directory is whole

A save goes to ``iter_XXXXXXX.partial`` and is renamed once every rank has written; the
tracker file is replaced atomically after that. A directory without the completion
marker is torn and is refused at load with a message naming the earlier whole ones.
The distributed optimizer is saved ``fully_reshardable`` (0.16.1's default sharding
type fails to save).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE = "jreg_complete.json"
RUN_CONFIG = "run_config.yaml"
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "chained_optim_avoid_prefix": True}


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def complete_iterations(root: str) -> List[int]:
    """Iterations under ``root`` whose directories are whole, ascending."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit():
            if os.path.exists(os.path.join(root, name, COMPLETE)):
                found.append(int(name[5:]))
    return sorted(found)


def resolve_iteration(root: str, iteration: Optional[int] = None, step_flag: str = "--ckpt-step",
                      root_flag: str = "--load") -> int:
    """The iteration to load: ``iteration`` or the tracker's, checked to be whole. Messages
    name the caller's flags (``step_flag`` picks an iteration, ``root_flag`` the directory)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root!r} does not exist; check {root_flag}")
    whole = complete_iterations(root)
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.exists(tracker):
            if os.path.exists(os.path.join(root, COMPLETE)):  # an iter_ directory itself
                raise CheckpointError(
                    f"{root!r} is one iteration's directory; pass its parent to {root_flag} and "
                    f"{step_flag} {os.path.basename(root)[5:].lstrip('0') or 0}")
            raise CheckpointError(
                f"{root!r} has no {TRACKER}: not a megatron-jreg checkpoint directory, or no "
                f"save finished" + (f"; whole iterations here: {whole}, pick one with {step_flag}"
                                    if whole else ""))
        text = open(tracker).read().strip()
        if not text.isdigit():
            raise CheckpointError(f"{tracker} holds {text!r}, not an iteration number")
        iteration = int(text)
    path = iteration_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"iteration {iteration} is not under {root!r}; whole iterations: {whole or 'none'}")
    if not os.path.exists(os.path.join(path, COMPLETE)):
        earlier = [i for i in whole if i < iteration]
        hint = (f"load an earlier one with {step_flag} {earlier[-1]}" if earlier
                else f"no earlier whole checkpoint exists; start without {root_flag}")
        raise CheckpointError(f"checkpoint {path} is incomplete (torn save: no {COMPLETE}); {hint}")
    return iteration


def read_run_config(path: str) -> Optional[str]:
    """The YAML run config saved with an iteration directory, or None."""
    file = os.path.join(path, RUN_CONFIG)
    return open(file).read() if os.path.exists(file) else None


EMBEDDING_KEY = "embedding.word_embeddings.weight"


def saved_embedding_rows(path: str, step_flag: str = "--ckpt-step") -> int:
    """Rows of the embedding saved in iteration directory ``path``: the padded vocabulary
    the run was built with (from the dist-checkpoint metadata; no tensor is read)."""
    from megatron.core import dist_checkpointing

    try:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception as err:
        raise CheckpointError(
            f"cannot read the tensor metadata of {path} ({type(err).__name__}); the directory "
            f"may be damaged: load an earlier one with {step_flag}") from None
    if EMBEDDING_KEY not in metadata:
        raise CheckpointError(f"{path} holds no {EMBEDDING_KEY}; not a GPT checkpoint")
    return int(metadata[EMBEDDING_KEY].global_shape[0])


def model_sharded_state_dict(model_chunks) -> Dict:
    modules = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    if len(modules) == 1:
        return {"model": modules[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(modules)}


def _rng_state() -> Dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler,
                    run_config_yaml: str, train_state: Dict) -> str:
    """Write iteration ``iteration`` under ``root``; collective over all ranks."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank() if dist.is_initialized() else 0
    final = iteration_dir(root, iteration)
    partial = final + ".partial"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    state = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=SHARDING_METADATA)
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["iteration"] = iteration
    state["train_state"] = train_state
    dist_checkpointing.save(state, partial, content_metadata=SHARDING_METADATA)
    os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
    torch.save(_rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        with open(os.path.join(partial, RUN_CONFIG), "w") as f:
            f.write(run_config_yaml)
        with open(os.path.join(partial, COMPLETE), "w") as f:
            json.dump({"iteration": iteration,
                       "world_size": dist.get_world_size() if dist.is_initialized() else 1}, f)
        # Saving an iteration again (a run resumed from an earlier one): move the old copy
        # aside first, so a crash here leaves one complete copy under some name.
        stale = final + ".replaced"
        shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, stale)
        os.replace(partial, final)
        shutil.rmtree(stale, ignore_errors=True)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    _barrier()
    return final


def load_checkpoint(root: str, iteration: Optional[int], model_chunks, optimizer=None,
                    scheduler=None, step_flag: str = "--ckpt-step") -> Tuple[int, Dict]:
    """Load weights (and optimizer, schedule, RNG when given); returns (iteration, train_state)."""
    from megatron.core import dist_checkpointing

    iteration = resolve_iteration(root, iteration, step_flag=step_flag)
    path = iteration_dir(root, iteration)
    state = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True,
                                                          metadata=SHARDING_METADATA)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = dist_checkpointing.load(state, path)
    # dist-ckpt raises many types for damaged files; torch's CheckpointException is a
    # BaseException, not an Exception
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"it may be corrupt: load an earlier one with {step_flag}") from err
    modules = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    keys = ["model"] if len(modules) == 1 else [f"model{i}" for i in range(len(modules))]
    for module, key in zip(modules, keys):
        module.load_state_dict(loaded[key])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    rank = dist.get_rank() if dist.is_initialized() else 0
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    if optimizer is not None and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
    return iteration, loaded.get("train_state") or {}
