"""Loading one torch_dist iteration, whoever saved it: this project (any earlier version),
Megatron-LM, a Transformer Engine or a local-spec model.

Before any tensor is read, the model's requests are compared with the checkpoint's
metadata (state_keys.py): a missing or unexpected weight, or one of another shape, is
named; Transformer Engine's ``_extra_state`` entries present on one side only are left
out and said once. The distributed optimizer's format comes from the checkpoint's content
metadata. The schedule, the samples consumed, the FLOPs so far and the random state are
read under whichever names the checkpoint holds them (ours, Megatron-LM's, an earlier
version's); a checkpoint without a random state says so in one line. A fully parallel load
(``--ckpt-fully-parallel-load``) reads each tensor several data-parallel ranks need once
and sends it to the others.
"""

from __future__ import annotations

import json
import os
from typing import Dict, Optional, Tuple

import torch.distributed as dist

from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.checkpoint import rng_state, safe_pickle
from megatron_jreg.checkpoint.manifest import verify_manifest
from megatron_jreg.checkpoint.scheduler_state import load_scheduler, saved_schedule
from megatron_jreg.checkpoint.state_keys import (
    EXTRA_STATE,
    checkpoint_entries,
    compare,
    drop_requests,
    requested_entries,
)
from megatron_jreg.errors import CheckpointError

def _read_metadata(path: str, step_flag: str):
    """(sharded metadata, common state) of iteration directory ``path``."""
    from megatron.core.dist_checkpointing import load_common_state_dict
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    try:
        return load_sharded_metadata(path), load_common_state_dict(path)
    except Exception as err:
        raise CheckpointError(
            f"cannot read the metadata of checkpoint {path} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}); the directory is damaged: "
            f"load an earlier one with {step_flag}") from None


def saved_layout(common: Dict) -> Optional[Tuple[int, int]]:
    """(TP, PP) the checkpoint was saved at, from Megatron-LM's ``args``; None when unknown."""
    args = common.get("args")
    if args is None:
        return None
    return (int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            int(getattr(args, "pipeline_model_parallel_size", 1) or 1))


def _layout_here() -> Tuple[int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())


def _optimizer_metadata(path: str, common: Dict, optimizer, fully_parallel: bool = False) -> Dict:
    """The content metadata the optimizer was saved with; for a distributed optimizer, its
    format checked against this layout (and against ``fully_parallel`` loading)."""
    from megatron.core.dist_checkpointing import load_content_metadata

    metadata = dict(load_content_metadata(preloaded_state_dict=common) or {})
    if not ckpt.is_distributed_optimizer(optimizer):
        return metadata  # the sharding type is the distributed optimizer's alone
    # megatron-core < 0.13 wrote none: Megatron-LM's rule for those
    args = common.get("args")
    metadata.setdefault("distrib_optim_sharding_type",
                        "fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", False)
                        else "dp_zero_gather_scatter")
    kind = metadata["distrib_optim_sharding_type"]
    if fully_parallel and kind == "dp_zero_gather_scatter":  # Megatron-LM refuses it too
        raise CheckpointError(
            f"checkpoint {path} holds the distributed optimizer's state as {kind} (Megatron-LM "
            "before megatron-core 0.13), which a fully parallel load cannot read: drop "
            "--ckpt-fully-parallel-load")
    saved, here = saved_layout(common), _layout_here()
    if saved and saved != here and kind not in ckpt.FULLY_RESHARDABLE:
        raise CheckpointError(
            f"checkpoint {path} holds the distributed optimizer's state as {kind}, which loads "
            f"only at the layout that saved it (TP {saved[0]} PP {saved[1]}; this run TP "
            f"{here[0]} PP {here[1]}): resume at that layout, or pass --no-load-optim to take "
            "the weights only (save with --dist-ckpt-optim-fully-reshardable to reshard later)")
    return metadata


def _rng_request(path: str, sharded_metadata: Dict):
    """The random state to load: Megatron-LM's sharded ``rng_state`` when saved at this
    layout, else None (earlier versions' files are read after the load; anything else is
    said in one line)."""
    grid = rng_state.saved_grid(sharded_metadata)
    if grid is not None:
        here = rng_state.grid_here()
        if grid == here:
            return rng_state.sharded_rng_state(loading=True)
        ckpt.report_once(f"random state not restored: {path} was saved with a (PP, TP) grid of "
                     f"{grid}, this run has {here}; it starts from --seed")
        return None
    if not os.path.isdir(os.path.join(path, ckpt.RNG_FILES_DIR)):
        ckpt.report_once(f"random state not restored: {path} holds none (saved without it); it "
                     "starts from --seed")
    return None


def _load_rng_files(path: str, rank: int) -> None:
    """An earlier version's per-rank random state files (``rng/rank_NNNNN.pt``)."""
    rng_file = os.path.join(path, ckpt.RNG_FILES_DIR, f"rank_{rank:05d}.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        with open(os.path.join(path, ckpt.COMPLETE)) as f:
            saved_world = int(json.load(f).get("world_size", world))
    except (OSError, ValueError, TypeError):
        saved_world = world
    if not os.path.exists(rng_file):
        if saved_world == world:
            raise CheckpointError(
                f"{rng_file} is missing (saved by {saved_world} ranks, as many as now); the "
                "directory is damaged: load an earlier one with --ckpt-step, or pass "
                "--no-load-rng to resume without the saved random state")
        ckpt.report_once(f"random state not restored: {path} was saved by {saved_world} ranks, "
                     f"this run has {world}")
        return
    try:
        state = safe_pickle.load_torch_file(rng_file, rng_file, "a checkpoint's random state file")
        rng_state.set_rng_state(state, ckpt.report_once, path)
    except safe_pickle.UnsafeCheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(
            f"cannot read {rng_file} ({type(err).__name__}); the directory is damaged: load "
            "an earlier one with --ckpt-step, or pass --no-load-rng") from None


def _load_modules(model_chunks, loaded: Dict, path: str) -> None:
    """Each chunk's weights; only ``_extra_state`` may be absent on either side."""
    for module, key in zip(model_chunks, ckpt.model_keys(len(model_chunks))):
        while hasattr(module, "module"):  # DDP, Float16Module (whose load returns nothing)
            module = module.module
        result = module.load_state_dict(loaded[key], strict=False)
        off = [k for k in (*result.missing_keys, *result.unexpected_keys)
               if not k.endswith(EXTRA_STATE)]
        if off:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {', '.join(off[:4])}")


def train_state_of(loaded: Dict) -> Dict:
    """The samples and tokens consumed and the FLOPs so far, from our ``train_state`` or
    Megatron-LM's ``args`` (consumed_tokens None: not recorded)."""
    state = dict(loaded.get("train_state") or {})
    args = loaded.get("args")
    if "consumed_samples" not in state and args is not None:
        state["consumed_samples"] = int(getattr(args, "consumed_train_samples", 0) or 0)
    state.setdefault("consumed_samples", 0)
    state.setdefault("consumed_tokens", None)
    flops = loaded.get("num_floating_point_operations_so_far")
    state["flops_so_far"] = float(flops) if flops is not None else None
    return state


def load_strategy(path: str, fully_parallel: bool):
    """None (megatron-core's default for ``path``), or with ``fully_parallel`` that strategy
    with each tensor needed by several data-parallel ranks read by one of them and sent to
    the others (Megatron-LM's --ckpt-fully-parallel-load, over the same group)."""
    if not fully_parallel:
        return None
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    return FullyParallelLoadStrategyWrapper(
        get_default_load_sharded_strategy(path),
        parallel_state.get_data_parallel_group(with_context_parallel=True))


def load_checkpoint(root: str, iteration: Optional[int], model_chunks, optimizer=None,
                    scheduler=None, step_flag: str = "--ckpt-step", verify: bool = True,
                    scheduler_mode: str = "strict", samples_per_iter: int = 1,
                    load_rng: bool = True, fully_parallel: bool = False) -> Tuple[int, Dict]:
    """Load weights (and optimizer, schedule, RNG when given); returns (iteration, train
    state: consumed_samples, consumed_tokens, flops_so_far).

    ``verify`` checks the manifest's checksums first (a save without one is not checked);
    ``scheduler_mode`` is load_scheduler's; ``fully_parallel`` spreads the reading over
    the data-parallel ranks (:func:`load_strategy`). Collective when distributed."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    iteration = ckpt.resolve_iteration(root, iteration, step_flag=step_flag)
    path = ckpt.iteration_path(root, iteration)  # iter_N, or a killed save's whole copy
    if verify:
        problem = verify_manifest(path)
        if problem:
            raise CheckpointError(
                f"checkpoint {path} fails its checksum: {problem}; load an earlier one with "
                f"{step_flag}" + (" (or pass --no-verify-checkpoint to load it anyway)"
                                  if step_flag == "--ckpt-step" else ""))
    # every pickle the load below unpickles, read as data first (safe_pickle.py)
    safe_pickle.check_iteration(path, step_flag)
    sharded_metadata, common = _read_metadata(path, step_flag)
    state = ckpt.model_sharded_state_dict(model_chunks)
    comparison = compare(requested_entries(state), checkpoint_entries(sharded_metadata))
    problem = comparison.problem()
    if problem:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {problem}; pass the model flags it "
            "was saved with (or --use-checkpoint-args)")
    for note in comparison.notes():
        ckpt.report_once(f"{path}: {note}")
    state = drop_requests(state, comparison.extra_missing)
    if optimizer is not None and "optimizer" not in common and not any(
            key.startswith("optimizer.") for key in sharded_metadata):
        raise CheckpointError(  # a conversion, or Megatron-LM's --no-save-optim
            f"checkpoint {path} holds weights only, no optimizer state to resume: start from "
            f"its weights with --pretrained-checkpoint {root} (or pass --no-load-optim)")
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True,
            metadata=_optimizer_metadata(path, common, optimizer, fully_parallel))
    rng_request = _rng_request(path, sharded_metadata) if optimizer is not None and load_rng else None
    if rng_request is not None:
        state["rng_state"] = rng_request
    try:
        loaded = dist_checkpointing.load(state, path, load_strategy(path, fully_parallel))
    # dist-ckpt raises many types for damaged files; torch's CheckpointException is a
    # BaseException, not an Exception
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            f"cannot read checkpoint {path} ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            f"it may be corrupt: load an earlier one with {step_flag}") from err
    _load_modules(model_chunks, loaded, path)
    bad = ckpt.nonfinite_anywhere(model_chunks)
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights {bad}; it is damaged: "
                              f"load an earlier one with {step_flag}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    schedule = saved_schedule(loaded)
    if scheduler is not None and schedule is not None:
        load_scheduler(scheduler, schedule, scheduler_mode, samples_per_iter)
    if rng_request is not None:
        rng_state.set_rng_state(rng_state.own_entry(loaded["rng_state"]), ckpt.report_once, path)
    elif optimizer is not None and load_rng and os.path.isdir(os.path.join(path, ckpt.RNG_FILES_DIR)):
        _load_rng_files(path, dist.get_rank() if dist.is_initialized() else 0)
    return iteration, train_state_of(loaded)
