"""Loading one torch_dist iteration, whoever saved it: this project (any earlier version),
Megatron-LM, a Transformer Engine or a local-spec model.

:func:`load_checkpoint` (the trainer's resume, ``model_loader``) compares the model's
requests with the checkpoint's metadata (state_keys.py) before any tensor is read, then loads
through the trusted open (trusted.py); the schedule, train state and random state are read
under whichever names the checkpoint holds them.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch.distributed as dist

from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.checkpoint import rng_state
from megatron_jreg.checkpoint.catalog import RNG_FILES_DIR
from megatron_jreg.checkpoint.faults import DamagedFile, MissingRngFile, UnsafeCheckpoint
from megatron_jreg.checkpoint.formats import Source
from megatron_jreg.checkpoint.notes import report_once
from megatron_jreg.checkpoint.scheduler_state import (
    adam_settings,
    keep_adam_settings,
    load_scheduler,
)
from megatron_jreg.checkpoint.state_keys import (
    EXTRA_STATE,
    checkpoint_entries,
    compare,
    drop_requests,
    requested_entries,
)
from megatron_jreg.errors import CheckpointError


def _layout_here() -> Tuple[int, int]:
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())


def _optimizer_metadata(source: Source, optimizer, fully_parallel: bool = False) -> Dict:
    """The content metadata the optimizer was saved with; for a distributed optimizer, its
    format checked against this layout (and against ``fully_parallel`` loading)."""
    fmt, path = source.format, source.path
    metadata = dict(fmt.sharding)
    if not ckpt.is_distributed_optimizer(optimizer):
        return metadata  # the sharding type is the distributed optimizer's alone
    metadata.setdefault("distrib_optim_sharding_type", fmt.unnamed_sharding)
    kind = metadata["distrib_optim_sharding_type"]
    if fully_parallel and kind == "dp_zero_gather_scatter":  # Megatron-LM refuses it too
        raise CheckpointError(
            f"checkpoint {path} holds the distributed optimizer's state as {kind} (Megatron-LM "
            "before megatron-core 0.13), which a fully parallel load cannot read: drop "
            "--ckpt-fully-parallel-load")
    saved, here = fmt.saved_layout, _layout_here()
    if saved and saved != here and kind not in ckpt.FULLY_RESHARDABLE:
        raise CheckpointError(
            f"checkpoint {path} holds the distributed optimizer's state as {kind}, which loads "
            f"only at the layout that saved it (TP {saved[0]} PP {saved[1]}; this run TP "
            f"{here[0]} PP {here[1]}): resume at that layout, or pass --no-load-optim to take "
            "the weights only (save with --dist-ckpt-optim-fully-reshardable to reshard later)")
    return metadata


def _rng_request(source: Source):
    """The random state to load: Megatron-LM's sharded ``rng_state`` when saved at this
    layout, else None (earlier versions' files are read after the load; anything else is
    said in one line)."""
    fmt, path = source.format, source.path
    if fmt.rng == "sharded":
        here = rng_state.grid_here()
        if fmt.rng_grid == here:
            return rng_state.sharded_rng_state(loading=True)
        report_once(f"random state not restored: {path} was saved with a (PP, TP) grid of "
                    f"{fmt.rng_grid}, this run has {here}; it starts from --seed")
    elif fmt.rng == "none":
        report_once(f"random state not restored: {path} holds none (saved without it); it "
                    "starts from --seed")
    return None


def _load_rng_files(source: Source, rank: int) -> None:
    """An earlier version's per-rank random state files (``rng/rank_NNNNN.pt``)."""
    name = f"{RNG_FILES_DIR}/rank_{rank:05d}.pt"
    rng_file = f"{source.path}/{name}"
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved_world = source.format.saved_world or world
    if name not in source.opened.files:
        if saved_world == world:
            raise MissingRngFile(file=rng_file, world=saved_world)
        report_once(f"random state not restored: {source.path} was saved by {saved_world} "
                    f"ranks, this run has {world}")
        return
    try:
        state = source.opened.read_torch(name, "a checkpoint's random state file")
        rng_state.set_rng_state(state, report_once, source.path)
    except (UnsafeCheckpoint, CheckpointError):
        raise
    except Exception as err:
        raise DamagedFile(path=source.path, checksum=False, rng=True,
                          detail=f"cannot read {rng_file} ({type(err).__name__})") from None


def _load_modules(model_chunks, loaded: Dict, path: str) -> None:
    """Each chunk's weights; only ``_extra_state`` may be absent on either side."""
    for module, key in zip(model_chunks, ckpt.model_keys(len(model_chunks))):
        while hasattr(module, "module"):  # DDP, Float16Module (whose load returns nothing)
            module = module.module
        result = module.load_state_dict(loaded[key], strict=False)
        off = [k for k in (*result.missing_keys, *result.unexpected_keys)
               if not k.endswith(EXTRA_STATE)]
        if off:
            raise CheckpointError(
                f"checkpoint {path} does not fit this model: {', '.join(off[:4])}")


def _fully_parallel_group():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def load_checkpoint(source: Source, model_chunks, optimizer=None, scheduler=None,
                    verify: bool = True, scheduler_mode: str = "strict",
                    samples_per_iter: int = 1, load_rng: bool = True,
                    fully_parallel: bool = False) -> Dict:
    """Load ``source``'s weights (and optimizer, schedule, RNG when given); returns its
    train state (consumed_samples, consumed_tokens, flops_so_far).

    ``verify`` checks the shards' checksums first (the trusted open checked the rest);
    ``scheduler_mode`` is load_scheduler's; ``fully_parallel`` spreads the reading over
    the data-parallel ranks. Collective when distributed."""
    from torch.distributed.checkpoint.api import CheckpointException

    path, fmt = source.path, source.format
    source.opened.check_shards(verify)
    state = ckpt.model_sharded_state_dict(model_chunks)
    comparison = compare(requested_entries(state), checkpoint_entries(source.opened.entries()))
    problem = comparison.problem()
    if problem:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: {problem}; pass the model flags it "
            "was saved with (or --use-checkpoint-args)")
    for note in comparison.notes():
        report_once(f"{path}: {note}")
    state = drop_requests(state, comparison.extra_missing)
    if optimizer is not None and not fmt.holds_optimizer:
        raise CheckpointError(  # a conversion, or Megatron-LM's --no-save-optim
            f"checkpoint {path} holds weights only, no optimizer state to resume: start from "
            f"its weights with --pretrained-checkpoint {source.ref.root} (or pass --no-load-optim)")
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=True, metadata=_optimizer_metadata(source, optimizer, fully_parallel))
    rng_request = _rng_request(source) if optimizer is not None and load_rng else None
    if rng_request is not None:
        state["rng_state"] = rng_request
    try:
        loaded = source.opened.load(state, _fully_parallel_group() if fully_parallel else None)
    # dist-ckpt raises many types for damaged files; torch's CheckpointException is a
    # BaseException, not an Exception
    except (UnsafeCheckpoint, CheckpointError):
        raise
    except (Exception, CheckpointException) as err:
        raise DamagedFile(path=path, checksum=False, detail=(
            f"cannot read checkpoint {path} ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else ''}); it may be corrupt")) from err
    _load_modules(model_chunks, loaded, path)
    bad = ckpt.nonfinite_anywhere(model_chunks)
    if bad:
        raise DamagedFile(path=path, checksum=False,
                          detail=f"checkpoint {path} holds non-finite weights {bad}")
    if optimizer is not None:
        mine = adam_settings(optimizer)
        optimizer.load_state_dict(loaded["optimizer"])
        keep_adam_settings(optimizer, mine, scheduler_mode)
    if scheduler is not None and fmt.schedule is not None:
        load_scheduler(scheduler, fmt.schedule, scheduler_mode, samples_per_iter)
    if rng_request is not None:
        rng_state.set_rng_state(rng_state.own_entry(loaded["rng_state"]), report_once, path)
    elif optimizer is not None and load_rng and fmt.rng == "files":
        _load_rng_files(source, dist.get_rank() if dist.is_initialized() else 0)
    return dict(fmt.train_state)
