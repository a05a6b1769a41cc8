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

Each run names its temporary directory and tracker file with its own run id, and
``jreg_manifest.json`` (per-file CRC-32, see manifest.py) is written before the
completion marker and checked at load. A missing tracker (or one left as ``.tmp`` by a
kill between the rename and the tracker update) is recovered from the newest whole
iteration. Non-finite parameters are never saved.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_jreg.checkpoint.manifest import verify_manifest, write_manifest
from megatron_jreg.checkpoint.rng_state import rng_state, set_rng_state
from megatron_jreg.errors import UserError

TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE = "jreg_complete.json"
RUN_CONFIG = "run_config.yaml"
CHAT_TEMPLATE = "chat_template.jinja"  # an SFT run's chat template, for the HF export
TOKENIZER_DIR = "tokenizer"  # a Hugging Face tokenizer's files, carried (see carry_tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "added_tokens.json")
SHARDING_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "chained_optim_avoid_prefix": True}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used; the message says why and what to do (a user error:
    one line, exit 2)."""


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
            if not whole:
                raise CheckpointError(
                    f"{root!r} has no {TRACKER} and no whole iter_XXXXXXX directory: not a "
                    "megatron-jreg checkpoint directory, or no save finished")
            # a kill between the rename of iter_N and the tracker update, or a copy by hand
            _report_once(f"{root}: no {TRACKER}; using the newest whole iteration {whole[-1]}")
            return whole[-1]
        iteration = read_tracker(tracker, step_flag)
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


_reported = set()


def _report_once(message: str) -> None:
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


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler,
                    run_config_yaml: str, train_state: Dict, run_id: str = "0",
                    extra_files: Optional[Dict[str, str]] = None,
                    tokenizer_dir: Optional[str] = None) -> str:
    """Write iteration ``iteration`` under ``root``; collective over all ranks.

    ``run_id`` (the same on every rank) names the temporary directory and tracker file,
    so no two runs share one. ``extra_files`` (name -> text) go beside the run config, and
    ``tokenizer_dir``'s Hugging Face tokenizer files are copied into ``tokenizer/``
    (:func:`carry_tokenizer`).
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
    state = model_sharded_state_dict(model_chunks)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=SHARDING_METADATA)
    state["scheduler"] = scheduler_state(scheduler) if scheduler is not None else None
    state["iteration"] = iteration
    state["train_state"] = train_state
    dist_checkpointing.save(state, partial, content_metadata=SHARDING_METADATA)
    os.makedirs(os.path.join(partial, "rng"), exist_ok=True)
    torch.save(rng_state(), os.path.join(partial, "rng", f"rank_{rank:05d}.pt"))
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
        # aside first, so a crash here leaves one complete copy under some name.
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
    return final


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


SCHEDULER_FLAGS = {  # scheduler state key -> (flag, unit: samples per flag unit or None)
    "max_lr": ("--lr", None), "min_lr": ("--min-lr", None),
    "lr_warmup_steps": ("--lr-warmup-iters", "iters"),
    "lr_decay_steps": ("--lr-decay-iters", "iters"), "lr_decay_style": ("--lr-decay-style", None),
    "wsd_decay_steps": ("--lr-wsd-decay-iters", "iters"),
    "lr_wsd_decay_style": ("--lr-wsd-decay-style", None),
    "start_wd": ("--weight-decay", None),
}


def scheduler_state(scheduler) -> Dict:
    """megatron's scheduler state plus the WSD fields its state_dict leaves out."""
    state = scheduler.state_dict()
    state["wsd_decay_steps"] = scheduler.wsd_decay_steps
    state["lr_wsd_decay_style"] = scheduler.lr_wsd_decay_style
    return state


def scheduler_differences(scheduler, saved: Dict, samples_per_iter: int) -> List[str]:
    """'flag: flags give X, the checkpoint Y' for each schedule value that differs."""
    out = []
    for key, (flag, unit) in SCHEDULER_FLAGS.items():
        if key not in saved:
            continue
        mine, theirs = getattr(scheduler, key), saved[key]
        if mine == theirs:
            continue
        if unit and isinstance(mine, int) and isinstance(theirs, int):
            mine, theirs = mine / samples_per_iter, theirs / samples_per_iter
            mine, theirs = (int(v) if float(v).is_integer() else v for v in (mine, theirs))
        out.append(f"{flag} {mine} (the checkpoint's {theirs})")
    return out


def load_scheduler(scheduler, saved: Dict, mode: str, samples_per_iter: int) -> None:
    """Megatron-LM's rule: ``override`` takes the flags, ``checkpoint`` the checkpoint's
    values, ``strict`` (neither flag) requires them to agree."""
    if mode == "strict":
        diffs = scheduler_differences(scheduler, saved, samples_per_iter)
        if diffs:
            raise CheckpointError(
                "the learning-rate schedule differs from the checkpoint's: " + "; ".join(diffs)
                + ". Pass --override-opt-param-scheduler to use the flags or "
                "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    scheduler.override_opt_param_scheduler = mode == "override"
    scheduler.use_checkpoint_opt_param_scheduler = mode != "override"
    scheduler.load_state_dict(saved)
    if mode == "override":
        # megatron reads the peak/final lr per parameter group first, and the optimizer's
        # loaded state brought back the checkpoint's
        for group in scheduler.optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group:
                    group[key] = getattr(scheduler, key)
        scheduler.step(increment=0)
    else:
        for key in ("wsd_decay_steps", "lr_wsd_decay_style"):
            if key in saved:
                setattr(scheduler, key, saved[key])


def _load_rng(path: str, rank: int) -> None:
    rng_file = os.path.join(path, "rng", f"rank_{rank:05d}.pt")
    world = dist.get_world_size() if dist.is_initialized() else 1
    try:
        with open(os.path.join(path, COMPLETE)) as f:
            saved_world = int(json.load(f).get("world_size", world))
    except (OSError, ValueError, TypeError):
        saved_world = world
    if not os.path.exists(rng_file):
        if saved_world == world:
            raise CheckpointError(
                f"{rng_file} is missing (saved by {saved_world} ranks, as many as now); the "
                "directory is damaged: load an earlier one with --ckpt-step, or pass "
                "--no-load-rng to resume without the saved random state")
        _report_once(f"random state not restored: {path} was saved by {saved_world} ranks, "
                     f"this run has {world}")
        return
    try:
        state = torch.load(rng_file, weights_only=False)
        set_rng_state(state, _report_once, path)
    except Exception as err:
        raise CheckpointError(
            f"cannot read {rng_file} ({type(err).__name__}); the directory is damaged: load "
            "an earlier one with --ckpt-step, or pass --no-load-rng") from None


def load_checkpoint(root: str, iteration: Optional[int], model_chunks, optimizer=None,
                    scheduler=None, step_flag: str = "--ckpt-step", verify: bool = True,
                    scheduler_mode: str = "strict", samples_per_iter: int = 1,
                    load_rng: bool = True) -> Tuple[int, Dict]:
    """Load weights (and optimizer, schedule, RNG when given); returns (iteration, train_state).

    ``verify`` checks the manifest's checksums first; ``scheduler_mode`` is load_scheduler's."""
    from megatron.core import dist_checkpointing

    iteration = resolve_iteration(root, iteration, step_flag=step_flag)
    path = iteration_dir(root, iteration)
    if verify:
        problem = verify_manifest(path)
        if problem:
            raise CheckpointError(
                f"checkpoint {path} fails its checksum: {problem}; load an earlier one with "
                f"{step_flag}" + (" (or pass --no-verify-checkpoint to load it anyway)"
                                  if step_flag == "--ckpt-step" else ""))
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
    bad = nonfinite_anywhere(model_chunks)
    if bad:
        raise CheckpointError(f"checkpoint {path} holds non-finite weights {bad}; it is damaged: "
                              f"load an earlier one with {step_flag}")
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and loaded.get("scheduler") is not None:
        load_scheduler(scheduler, loaded["scheduler"], scheduler_mode, samples_per_iter)
    if optimizer is not None and load_rng:
        _load_rng(path, dist.get_rank() if dist.is_initialized() else 0)
    return iteration, loaded.get("train_state") or {}
