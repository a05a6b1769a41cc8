"""Checkpoints in Megatron's layout with dist-checkpointing (torch_dist), readable and
resumable by Megatron-LM, and reading Megatron-LM's.

    SAVE/latest_checkpointed_iteration.txt
    SAVE/iter_0000100/            dist-ckpt shards, .metadata, common.pt, metadata.json
                      run_config.yaml     the resolved config of the run
                      tokenizer/          a Hugging Face tokenizer's files, carried
                      jreg_manifest.json  per-file CRC-32 (manifest.py)
                      jreg_complete.json  written last: the directory is whole

The common state carries Megatron-LM's fields beside ours: ``args`` (the run as
Megatron-LM's argument namespace, megatron_lm_args.py), ``checkpoint_version`` 3.0,
``iteration``, ``opt_param_scheduler``, ``num_floating_point_operations_so_far``; the
random state is Megatron-LM's sharded ``rng_state`` (rng_state.py). The distributed
optimizer is saved ``dp_reshardable`` (Megatron-LM's default) or, with
``--dist-ckpt-optim-fully-reshardable``, ``fully_reshardable``; the content metadata says
which, and a load reads it from there.

A save goes to ``iter_XXXXXXX.partial-RUNID`` and is renamed once every rank has written;
the tracker file is replaced atomically after that. The tensors are written before
``save_checkpoint`` returns, or in the background (``--async-save``, async_save.py), when
the rest waits for the finalize that follows every rank's writes. The tensors that
data-parallel ranks hold alike are written by the first of them, or spread over them all
(``--ckpt-fully-parallel-save``); either way the checkpoint holds the same. An iteration directory of ours without
the completion marker is torn and is refused at load with a message naming the earlier
whole ones. One that holds none of our files was saved by another megatron-core program
(Megatron-LM): dist-checkpointing writes its ``metadata.json`` last, after every rank's
shards and the global ``.metadata``, so with both it is whole.

A missing tracker (or one left as ``.tmp`` by a kill between the rename and the tracker
update) is recovered from the newest whole iteration. Non-finite parameters are never
saved. Loading is loading.py's.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_jreg.checkpoint.interrupted import COMPLETE, left_whole
from megatron_jreg.checkpoint.manifest import MANIFEST, write_manifest
from megatron_jreg.checkpoint.rng_state import sharded_rng_state
from megatron_jreg.checkpoint.safe_pickle import check_metadata
from megatron_jreg.checkpoint.scheduler_state import SCHEDULE_KEYS, scheduler_state
from megatron_jreg.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"
CHAT_TEMPLATE = "chat_template.jinja"  # an SFT run's chat template, for the HF export
TOKENIZER_DIR = "tokenizer"  # a Hugging Face tokenizer's files, carried (see carry_tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "added_tokens.json")
RNG_FILES_DIR = "rng"  # earlier versions' per-rank random state files
OWN_FILES = (COMPLETE, MANIFEST, RUN_CONFIG, RNG_FILES_DIR)  # any of them: a save of ours
# what dist-checkpointing writes of every save, metadata.json last
DIST_CKPT_FILES = (".metadata", "common.pt", "metadata.json")
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
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_path(root: str, iteration: int) -> str:
    """Where to read ``iteration``: iter_N, or the whole copy a save killed in its renames
    left under a temporary name (interrupted.py; the next run holding the lock renames it)."""
    path, left = iteration_dir(root, iteration), None
    if not os.path.isdir(path):
        left = left_whole(root).get(iteration)
    return os.path.join(root, left) if left else path


def is_own(path: str) -> bool:
    """An iteration directory written by this project (whole or not)."""
    return any(os.path.exists(os.path.join(path, name)) for name in OWN_FILES)


def torn_reason(path: str) -> Optional[str]:
    """None when iteration directory ``path`` is whole, else what is missing: our completion
    marker (a save of ours), or dist-checkpointing's last files (another program's)."""
    if os.path.exists(os.path.join(path, COMPLETE)):
        return None
    if is_own(path):
        return f"no {COMPLETE}"
    absent = [n for n in DIST_CKPT_FILES if not os.path.exists(os.path.join(path, n))]
    return f"no {', '.join(absent)}" if absent else None


def complete_iterations(root: str) -> List[int]:
    """Iterations under ``root`` whose directories are whole, ascending."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        if name.startswith("iter_") and name[5:].isdigit():
            path = os.path.join(root, name)
            if os.path.isdir(path) and torn_reason(path) is None:
                found.append(int(name[5:]))
    return sorted(found)


def resolve_iteration(root: str, iteration: Optional[int] = None, step_flag: str = "--ckpt-step",
                      root_flag: str = "--load") -> int:
    """The iteration to load: ``iteration`` or the tracker's, checked to be whole. Messages
    name the caller's flags (``step_flag`` picks an iteration, ``root_flag`` the directory)."""
    if not os.path.isdir(root):
        raise CheckpointError(f"checkpoint directory {root!r} does not exist; check {root_flag}")
    whole = sorted(set(complete_iterations(root)) | set(left_whole(root)))
    if iteration is None:
        tracker = os.path.join(root, TRACKER)
        if not os.path.exists(tracker):
            if os.path.basename(os.path.normpath(root)).startswith("iter_") and \
                    torn_reason(root) is None:  # an iter_ directory itself
                raise CheckpointError(
                    f"{root!r} is one iteration's directory; pass its parent to {root_flag} and "
                    f"{step_flag} {os.path.basename(root)[5:].lstrip('0') or 0}")
            if not whole:
                raise CheckpointError(
                    f"{root!r} has no {TRACKER} and no whole iter_XXXXXXX directory: not a "
                    "torch_dist checkpoint directory, or no save finished")
            # a kill between the rename of iter_N and the tracker update, or a copy by hand
            report_once(f"{root}: no {TRACKER}; using the newest whole iteration {whole[-1]}")
            return whole[-1]
        iteration = read_tracker(tracker, step_flag)
    path = iteration_path(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(
            f"iteration {iteration} is not under {root!r}; whole iterations: {whole or 'none'}")
    torn = torn_reason(path)
    if torn:
        earlier = [i for i in whole if i < iteration]
        hint = (f"load an earlier one with {step_flag} {earlier[-1]}" if earlier
                else f"no earlier whole checkpoint exists; start without {root_flag}")
        raise CheckpointError(f"checkpoint {path} is incomplete (torn save: {torn}); {hint}")
    return iteration


_reported = set()


def report_once(message: str) -> None:
    if message not in _reported and (not dist.is_initialized() or dist.get_rank() == 0):
        print(message, flush=True)
    _reported.add(message)


def read_tracker(tracker: str, step_flag: str = "--ckpt-step") -> int:
    with open(tracker, "rb") as f:
        raw = f.read(64)
    text = raw.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker} holds {text[:20]!r}, not an iteration number; delete it to resume from "
            f"the newest whole iteration, or pick one with {step_flag}")
    return int(text)


def read_run_config(path: str) -> Optional[str]:
    """The YAML run config saved with an iteration directory, or None."""
    file = os.path.join(path, RUN_CONFIG)
    return open(file).read() if os.path.exists(file) else None


EMBEDDING_KEY = "embedding.word_embeddings.weight"


def saved_embedding_rows(path: str, step_flag: str = "--ckpt-step") -> int:
    """Rows of the embedding saved in iteration directory ``path``: the padded vocabulary
    the run was built with (from the dist-checkpoint metadata; no tensor is read)."""
    from megatron.core import dist_checkpointing

    check_metadata(path, step_flag)  # torch unpickles it with no restriction
    try:
        metadata = dist_checkpointing.load_tensors_metadata(path)
    except Exception as err:
        raise CheckpointError(
            f"cannot read the tensor metadata of {path} ({type(err).__name__}); the directory "
            f"may be damaged: load an earlier one with {step_flag}") from None
    if EMBEDDING_KEY not in metadata:
        raise CheckpointError(f"{path} holds no {EMBEDDING_KEY}; not a GPT checkpoint")
    return int(metadata[EMBEDDING_KEY].global_shape[0])


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
