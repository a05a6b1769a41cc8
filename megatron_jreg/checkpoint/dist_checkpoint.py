"""Saving a checkpoint in Megatron's layout with dist-checkpointing (torch_dist), readable
and resumable by Megatron-LM.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/  dist-ckpt shards, .metadata, common.pt, metadata.json,
                        run_config.yaml, tokenizer/, jreg_manifest.json, jreg_complete.json

The trainer's ``training.checkpointing`` calls :func:`save_checkpoint`; a save goes to
``iter_N.partial-RUNID`` and is renamed once every rank has written. Reading is catalog.py's,
trusted.py's, formats.py's and loading.py's.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_jreg.checkpoint.catalog import RUN_CONFIG, TOKENIZER_DIR, TRACKER, iteration_name
from megatron_jreg.checkpoint.interrupted import COMPLETE
from megatron_jreg.checkpoint.manifest import write_manifest
from megatron_jreg.checkpoint.rng_state import sharded_rng_state
from megatron_jreg.checkpoint.scheduler_state import SCHEDULE_KEYS, scheduler_state
from megatron_jreg.errors import CheckpointError

CHAT_TEMPLATE = "chat_template.jinja"  # an SFT run's chat template, for the HF export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "added_tokens.json")
# distributed-optimizer formats that reload at any TP/PP layout (megatron-core's
# DistributedOptimizer.checkpoint_fully_reshardable_formats)
FULLY_RESHARDABLE = ("fully_reshardable", "fully_sharded_model_space", "fsdp_dtensor")


def is_distributed_optimizer(optimizer) -> bool:
    """True when ``optimizer`` (megatron's, possibly chained) shards its state over the
    data-parallel ranks (megatron-core's DistributedOptimizer)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(part, DistributedOptimizer) for part in parts)


def sharding_metadata(fully_reshardable: bool, distributed: bool = True) -> Dict:
    """The content metadata of a save (Megatron-LM's for the same flags): how the
    distributed optimizer's state is sharded (nothing to say without one)."""
    metadata: Dict = {}
    if distributed:
        metadata["distrib_optim_sharding_type"] = ("fully_reshardable" if fully_reshardable
                                                   else "dp_reshardable")
        if fully_reshardable:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    return metadata


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, iteration_name(iteration))


def model_keys(count: int) -> List[str]:
    """The state keys of ``count`` model chunks (Megatron-LM's: ``model``, or ``model0``...)."""
    return ["model"] if count == 1 else [f"model{i}" for i in range(count)]


def model_sharded_state_dict(model_chunks) -> Dict:
    modules = [getattr(chunk, "module", chunk) for chunk in model_chunks]
    return {key: m.sharded_state_dict() for key, m in zip(model_keys(len(modules)), modules)}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def nonfinite_parameters(model_chunks) -> List[str]:
    """Names of this rank's parameters holding a NaN or inf (the first few)."""
    names, finite = [], []
    for i, chunk in enumerate(model_chunks):
        for name, param in chunk.named_parameters():
            while name.startswith("module."):  # DDP / Float16Module wrappers
                name = name[len("module."):]
            names.append(name if len(model_chunks) == 1 else f"chunk {i}: {name}")
            finite.append(torch.isfinite(param.detach()).all())
    if not finite:
        return []
    flags = torch.stack(finite).tolist()  # one wait for the device, not one per parameter
    return [name for name, ok in zip(names, flags) if not ok][:3]


def _any_rank(flag: bool, device=None) -> bool:
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def nonfinite_anywhere(model_chunks) -> Optional[str]:
    """None when every rank's parameters are finite, else what to name: '(names)' of this
    rank's or 'on another rank' (collective when distributed)."""
    bad = nonfinite_parameters(model_chunks)
    if not _any_rank(bool(bad), next(model_chunks[0].parameters()).device):
        return None
    return f"({', '.join(bad)})" if bad else "on another rank"


def save_strategy(fully_parallel: bool):
    """The sharded save strategy: megatron-core's default, or with ``fully_parallel`` that
    strategy spreading the tensors data-parallel ranks hold alike over those ranks
    (Megatron-LM's --ckpt-fully-parallel-save, over the same group)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = get_default_save_sharded_strategy()
    if not fully_parallel:
        return strategy
    return FullyParallelSaveStrategyWrapper(
        strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler,
                    run_config_yaml: str, train_state: Dict, run_id: str = "0",
                    extra_files: Optional[Dict[str, str]] = None,
                    tokenizer_dir: Optional[str] = None, common: Optional[Dict] = None,
                    fully_reshardable: bool = False, fully_parallel: bool = False,
                    background=None, before_complete: Optional[Callable[[], None]] = None) -> str:
    """Write iteration ``iteration`` under ``root``; collective over all ranks. Returns the
    iteration directory it becomes.

    ``run_id`` (the same on every rank) names the temporary directory and tracker file,
    so no two runs share one. ``extra_files`` (name -> text) go beside the run config, and
    ``tokenizer_dir``'s Hugging Face tokenizer files are copied into ``tokenizer/``
    (:func:`carry_tokenizer`). ``common`` adds entries to the common state (Megatron-LM's
    ``args``, ``checkpoint_version``, FLOPs so far); ``fully_reshardable`` picks the
    distributed optimizer's format (:func:`sharding_metadata`), ``fully_parallel`` the
    save strategy (:func:`save_strategy`). With ``background`` (an ``async_save.AsyncSaver``
    with no save pending) the tensors are written in the background and the directory is
    completed by its ``finalize``; without it, before this returns. ``before_complete``
    (collective; raising stops the save unmarked) runs on every rank before the directory
    is completed: the trainer checks there that it still holds ``--save``'s lock.
    Raises CheckpointError, having written nothing, when any parameter is non-finite."""
    from megatron.core import dist_checkpointing

    bad = nonfinite_anywhere(model_chunks)
    if bad:
        raise CheckpointError(
            f"refusing to save iteration {iteration}: non-finite parameters {bad}; the last "
            f"whole checkpoint in {root} is kept. Lower --lr or check the data")
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = iteration_dir(root, iteration)
    partial = f"{final}.partial-{run_id}"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    metadata = sharding_metadata(fully_reshardable, optimizer is not None
                                 and is_distributed_optimizer(optimizer))
    state = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    if scheduler is not None:
        state[SCHEDULE_KEYS[0]] = scheduler_state(scheduler)
    state.update(common or {})
    state["iteration"] = iteration
    state["train_state"] = train_state
    state["rng_state"] = sharded_rng_state()
    if background is not None:
        background.start()
    written = dist_checkpointing.save(state, partial, save_strategy(fully_parallel),
                                      async_sharded_save=background is not None,
                                      content_metadata=metadata)

    def complete():  # once every rank's tensors are on disk
        if before_complete is not None:
            try:
                before_complete()
            except BaseException:  # this save's own directory: no one else writes it
                if rank == 0:
                    shutil.rmtree(partial, ignore_errors=True)
                raise
        _complete(root, iteration, partial, run_config_yaml, extra_files, tokenizer_dir, run_id)

    if background is None:
        complete()
    else:  # megatron-core's functions (.metadata, metadata.json) run first
        written.add_finalize_fn(complete)
        background.schedule(written, final, partial)
    return final


def _complete(root: str, iteration: int, partial: str, run_config_yaml: str,
              extra_files: Optional[Dict[str, str]], tokenizer_dir: Optional[str],
              run_id: str) -> None:
    """Our files, the manifest over every written file, the completion marker, then the
    rename and the tracker: collective, after every rank's shards are written."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    final = iteration_dir(root, iteration)
    _barrier()
    if rank == 0:
        for name, text in {RUN_CONFIG: run_config_yaml, **(extra_files or {})}.items():
            with open(os.path.join(partial, name), "w", encoding="utf-8") as f:
                f.write(text)
        if tokenizer_dir:
            carry_tokenizer(tokenizer_dir, os.path.join(partial, TOKENIZER_DIR))
    _barrier()
    write_manifest(partial)  # every rank hashes its share of the files
    if rank == 0:
        with open(os.path.join(partial, COMPLETE), "w") as f:
            json.dump({"iteration": iteration,
                       "world_size": dist.get_world_size() if dist.is_initialized() else 1}, f)
        # Saving an iteration again (a run resumed from an earlier one): move the old copy
        # aside first. From the marker on, a kill is finished by the next writer
        # (interrupted.py): never an iteration without iter_N, nor a whole one removed.
        stale = f"{final}.replaced-{run_id}"
        shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(final):
            os.replace(final, stale)
        os.replace(partial, final)
        shutil.rmtree(stale, ignore_errors=True)
        tmp = os.path.join(root, f"{TRACKER}.tmp-{run_id}")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    _barrier()


def carry_tokenizer(source: str, target: str) -> None:
    """Copy the tokenizer files of directory ``source`` (a tokenizer.json file: it and the
    files beside it) into ``target``: the checkpoint then holds the tokenizer it was
    trained with, wherever the original moves."""
    if os.path.isfile(source):
        source = os.path.dirname(source) or "."
    os.makedirs(target, exist_ok=True)
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
