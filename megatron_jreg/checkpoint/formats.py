"""What kind of iteration this is, decided once: the descriptor every load reads.

:func:`describe` reads an opened iteration (trusted.py) into an :class:`IterationFormat`:
who saved it (this project now, an earlier version of it, Megatron-LM, a Hugging Face
import), its run config (``run_config.yaml``, or built from Megatron-LM's ``args``), the
samples, tokens and FLOPs so far, its schedule, random state and optimizer sharding, and
its embedding rows. :func:`read` is the whole chain for a reader: catalog, trusted open,
descriptor. Imports neither megatron-core nor the model.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Mapping, Optional, Tuple

from megatron_jreg.checkpoint import catalog, claims, faults, rng_state, trusted
from megatron_jreg.checkpoint.catalog import TOKENIZER_DIR
from megatron_jreg.checkpoint.interrupted import COMPLETE
from megatron_jreg.checkpoint.megatron_lm_args import (
    COMMON_FILE,
    checked_arg,
    is_megatron_lm_state,
    sections_from_args,
)
from megatron_jreg.checkpoint.scheduler_state import saved_schedule
from megatron_jreg.config.run import SECTIONS
from megatron_jreg.config.yaml_settings import MAX_CONFIG_BYTES, from_yaml_text
from megatron_jreg.errors import InputError, UserError

EMBEDDING_KEY = "embedding.word_embeddings.weight"
OURS, EARLIER, MEGATRON_LM, HF_IMPORT = "ours", "ours (earlier version)", "Megatron-LM", "HF import"


@dataclasses.dataclass(frozen=True)
class IterationFormat:
    """One iteration as a load reads it (every field decided by :func:`describe`)."""

    kind: str  # OURS, EARLIER, MEGATRON_LM or HF_IMPORT
    configs: Mapping[str, object]  # the run's config sections (config.run.SECTIONS)
    train_state: Mapping[str, object]  # consumed_samples, consumed_tokens, flops_so_far
    schedule: Optional[Mapping[str, object]]  # the scheduler's state, under any name
    rng: str  # "sharded" (Megatron-LM's rng_state), "files" (rng/rank_N.pt) or "none"
    rng_grid: Optional[Tuple[int, ...]]
    holds_optimizer: bool
    sharding: Mapping[str, object]  # the content metadata (the optimizer's format)
    unnamed_sharding: str  # a distributed optimizer's format where the metadata names none
    saved_layout: Optional[Tuple[int, int]]  # (TP, PP) from Megatron-LM's args
    saved_world: Optional[int]  # ranks that saved it (our completion marker)
    embedding_rows: Optional[int]  # None: no .metadata (a load names it)
    has_run_config: bool
    carried_tokenizer: Optional[str]  # the tokenizer/ directory inside the iteration


def _configs(opened: trusted.Opened) -> Tuple[Dict[str, object], bool]:
    text = opened.read_text(catalog.RUN_CONFIG, limit=MAX_CONFIG_BYTES)
    if text is None:
        if is_megatron_lm_state(opened.common):
            return sections_from_args(opened.common["args"], opened.path), False
        raise faults.NotAModel(root=opened.ref.root, detail=(
            f"{opened.path} has neither {catalog.RUN_CONFIG} nor Megatron-LM's args in its "
            "common state, so the model cannot be rebuilt; give a checkpoint saved by this "
            "project's trainer or by Megatron-LM"))
    try:
        configs = from_yaml_text(text, SECTIONS, os.path.join(opened.path, catalog.RUN_CONFIG))
    except UserError as err:  # its bounds, YAML, keys and values, each naming the file
        raise InputError(str(err)) from None
    except Exception as err:  # anything else a section's construction raises
        raise InputError(
            f"{os.path.join(opened.path, catalog.RUN_CONFIG)}: cannot rebuild the run config "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        ) from None
    carried = _carried(opened)
    if carried and configs["data"].tokenizer_type == "HuggingFaceTokenizer":
        # the files the run used, wherever it moved
        configs["data"] = dataclasses.replace(configs["data"], tokenizer_model=carried)
    return configs, True


def _carried(opened: trusted.Opened) -> Optional[str]:
    name = os.path.join(TOKENIZER_DIR, "tokenizer.json")
    return os.path.join(opened.path, TOKENIZER_DIR) if name in opened.files else None


def _train_state(common: Mapping, where: str) -> Dict[str, object]:
    """Samples and tokens consumed and FLOPs so far, from our ``train_state`` or
    Megatron-LM's ``args`` (consumed_tokens None: not recorded)."""
    state = dict(common.get("train_state") or {})
    args = common.get("args")
    if "consumed_samples" not in state and args is not None:
        state["consumed_samples"] = checked_arg(args, "consumed_train_samples", where, int) or 0
    state.setdefault("consumed_samples", 0)
    state.setdefault("consumed_tokens", None)
    flops = common.get("num_floating_point_operations_so_far")
    state["flops_so_far"] = float(flops) if flops is not None else None
    return state


def _saved_layout(common: Mapping, where: str) -> Optional[Tuple[int, int]]:
    args = common.get("args")
    if args is None:
        return None
    return (checked_arg(args, "tensor_model_parallel_size", where, int) or 1,
            checked_arg(args, "pipeline_model_parallel_size", where, int) or 1)


def unnamed_sharding(common: Mapping) -> str:
    """The distributed optimizer's format of a save whose content metadata names none
    (megatron-core < 0.13 wrote none): Megatron-LM's rule, from its args."""
    args = common.get("args")
    return ("fully_sharded_model_space" if getattr(args, "ckpt_fully_parallel_save", False)
            else "dp_zero_gather_scatter")


def _saved_world(opened: trusted.Opened) -> Optional[int]:
    try:
        world = json.loads(opened.read_text(COMPLETE) or "null")
        world = world.get("world_size") if isinstance(world, dict) else None
        return int(world) if world is not None else None
    except (ValueError, TypeError):
        return None


def describe(opened: trusted.Opened) -> IterationFormat:
    common, entries = opened.common, opened.entries()
    configs, has_run_config = _configs(opened)
    rows = entries.get(EMBEDDING_KEY)
    if not rows and opened.metadata is not None:
        raise faults.NotAModel(
            root=opened.ref.root,
            detail=f"{opened.path} holds no {EMBEDDING_KEY}; not a GPT checkpoint")
    # the architecture claimed, compared with the tensors listed, before anything is built
    if has_run_config:
        claimed_by = f"{os.path.join(opened.path, catalog.RUN_CONFIG)}: model"
        fix = (f"{catalog.RUN_CONFIG} does not describe these weights; "
               "restore the one saved with them")
    else:
        claimed_by = f"{os.path.join(opened.path, COMMON_FILE)}: args"
        fix = ("the checkpoint's args do not describe its weights; it was edited or damaged: "
               "rebuild it with a tool you trust")
    claims.check(opened, configs["model"], claimed_by, fix)
    grid = rng_state.saved_grid(entries)
    rng_files = any(f.startswith(catalog.RNG_FILES_DIR + os.sep) for f in opened.files)
    if has_run_config and getattr(configs["data"], "imported_from", None):
        kind = HF_IMPORT
    elif has_run_config:
        kind = OURS if "args" in common else EARLIER
    else:
        kind = MEGATRON_LM
    return IterationFormat(
        kind=kind, configs=configs, train_state=_train_state(common, opened.path),
        schedule=saved_schedule(common),
        rng="sharded" if grid is not None else "files" if rng_files else "none", rng_grid=grid,
        holds_optimizer="optimizer" in common or any(k.startswith("optimizer.") for k in entries),
        sharding=opened.content_metadata(), unnamed_sharding=unnamed_sharding(common),
        saved_layout=_saved_layout(common, opened.path),
        saved_world=_saved_world(opened), embedding_rows=int(rows[0]) if rows else None,
        has_run_config=has_run_config, carried_tokenizer=_carried(opened))


@dataclasses.dataclass(frozen=True)
class Source:
    """An iteration found (catalog), opened (trusted) and described (this module)."""

    ref: catalog.Ref
    opened: trusted.Opened
    format: IterationFormat

    @property
    def path(self) -> str:
        return self.ref.path

    @property
    def iteration(self) -> int:
        return self.ref.iteration


def read(root: str, iteration: Optional[int] = None, verify: bool = True,
         found: Optional[catalog.Catalog] = None) -> Source:
    """The one way a reader takes an iteration of ``root``: resolve, open, describe."""
    ref = (found or catalog.scan(root)).resolve(iteration)
    opened = trusted.open_iteration(ref, verify=verify)
    return Source(ref, opened, describe(opened))
