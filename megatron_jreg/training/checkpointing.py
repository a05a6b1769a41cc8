"""The trainer's side of checkpoints: one writer per ``--save``, the vocabulary a resumed
checkpoint was padded to, resume and save. The format is ``megatron_jreg.checkpoint``'s."""

from __future__ import annotations

import os
import shutil
import sys
import time
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_jreg.checkpoint import catalog
from megatron_jreg.checkpoint.async_save import AsyncSaver
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir, save_checkpoint
from megatron_jreg.checkpoint.faults import TRAINER, Wording
from megatron_jreg.checkpoint.interrupted import finish_interrupted_saves
from megatron_jreg.checkpoint.loading import load_checkpoint
from megatron_jreg.checkpoint.megatron_lm_args import CHECKPOINT_VERSION, megatron_lm_args
from megatron_jreg.checkpoint.run_configs import build_run_tokenizer
from megatron_jreg.checkpoint.save_lock import SaveLock
from megatron_jreg.data.tokenizers.build import describe_tokenizer, tokenizer_identity
from megatron_jreg.data.tokenizers.records import earlier_record_fix, holds_same_ids, other_ids_fix
from megatron_jreg.distributed.setup import print_rank_0
from megatron_jreg.errors import (
    CheckpointError,
    ConfigError,
    InputError,
    os_write_error,
    write_error_at,
)
from megatron_jreg.training.checkpoint_args import architecture_differences
from megatron_jreg.training.experiment import ExperimentConfig
from megatron_jreg.training.source import StartingPoint


def _same_file(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


def _identity_of(saved) -> Optional[str]:
    """The tokenizer identity of a checkpoint saved before the pin, from its recorded
    tokenizer as it is now (its run config names it); None when it cannot be built."""
    try:
        return tokenizer_identity(build_run_tokenizer(saved))
    except (InputError, OSError, ValueError):
        return None


def _save_failure(err: BaseException, root: str, iteration: int,
                  run_id: str) -> Optional[BaseException]:
    """What to raise for a synchronous save that failed with ``err``, for the one line of
    ``errors.write_error_line`` (``commands.exit_codes.run_command``); None: ``err`` as it
    is. An OS error of writing behind ``err`` that names no file (our own files' writes
    fail at their close) is given the save's directory; where a library lost the error's
    number, what the save left in its directory tells it. megatron-core raises the
    writers' errors on rank 0 only: another rank says where to look. The directory stays
    unmarked; the next run removes it."""
    partial = f"{iteration_dir(root, iteration)}.partial-{run_id}"
    known = os_write_error(err)
    if known is not None:
        code, name = known
        return None if name else OSError(code, os.strerror(code), partial)
    found = write_error_at(partial) if os.path.isdir(partial) else None
    if found is not None:
        return found
    if getattr(err, "failures", None) == {}:  # a CheckpointException of a rank but 0
        return CheckpointError(f"the save of iteration {iteration} in {root} failed on "
                               "another rank: rank 0's error says why; the newest whole "
                               "checkpoint is kept")
    return None


class Checkpointer:
    """Loads and saves the run described by ``experiment`` (whose config each save records)."""

    def __init__(self, experiment: ExperimentConfig, start: Optional[StartingPoint] = None):
        self.experiment = experiment
        self.cfg = experiment.checkpoint
        self.start = start  # what setup loads (training.source), read once
        self.save_lock: Optional[SaveLock] = None
        self.run_id = "0"
        self.extra_files: Dict[str, str] = {}  # written into every saved iteration
        # --async-save: the shards of a save are written while training goes on
        self.background = AsyncSaver() if self.cfg.async_save else None

    def take_save_lock(self) -> None:
        """One writer per --save (rank 0 holds the lock for the job), taken before anything
        about --save is judged: under it, the run's lineage is checked
        (ExperimentConfig.check_save_lineage) and a killed run's leftovers are cleared, and
        only then is the starting point read. Every rank learns the outcome and the run id
        that names this run's temporary files."""
        self.run_id, self.save_lock = "0", None
        if not self.cfg.save:
            return
        outcome = [None, None, None]  # error, warning, run id
        if dist.get_rank() == 0:
            lock = SaveLock(self.cfg.save)
            try:
                outcome[1] = lock.acquire()
                self.save_lock = lock
                outcome[2] = lock.run_id
                self.experiment.check_save_lineage(catalog.scan(self.cfg.save))
                cleared = self._clear_stale_saves(lock.run_id)
                outcome[1] = "\n".join(filter(None, [outcome[1], cleared])) or None
            except (ValueError, OSError) as err:
                outcome[0] = (str(err) if isinstance(err, ValueError)
                              else f"--save {self.cfg.save}: cannot write there ({err.strerror})")
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise ConfigError(outcome[0])
        if outcome[1]:
            print_rank_0(outcome[1])
        self.run_id = outcome[2]
        if self.background is not None:  # its results queue's process: before training
            self.background.start()

    def _clear_stale_saves(self, run_id: str) -> Optional[str]:
        """Holding the lock, no other run writes here: a save killed in its renames is
        finished first (interrupted.py: its whole copy becomes iter_N), then the temporary
        directories and tracker files left by killed runs are removed: partials that never
        got their completion marker and replaced copies of a present iter_N."""
        root = self.cfg.save
        lines = finish_interrupted_saves(root, catalog.scan(root).left_whole, run_id)
        stale = catalog.scan(root).leftovers
        for name in stale:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        if stale:
            lines.append(f"removed {len(stale)} unfinished save(s) of earlier runs: "
                         f"{', '.join(sorted(stale))}")
        return "\n".join(lines) or None

    @property
    def wording(self) -> Wording:
        """The flags this run's checkpoint faults are phrased with (its source's flag)."""
        return Wording(root=self.start.flag) if self.start is not None else TRAINER

    def facts(self) -> dict:
        """What the checkpoint setup loads holds, for ``config.resolve.RunFacts``: its
        embedding rows (the run keeps them) and, when the run keeps the checkpoint's
        schedule (--use-checkpoint-opt-param-scheduler), that schedule."""
        start = self.start
        if start is None:
            return {}
        schedule = None
        if (self.experiment.optim.scheduler_mode() == "checkpoint"
                and not (self.cfg.no_load_optim or start.weights_only)):
            schedule = start.source.format.schedule
        start.source.opened.require_metadata()
        return {"checkpoint": f"{start.flag} {start.root}",
                "saved_embedding_rows": start.source.format.embedding_rows,
                "saved_schedule": schedule}

    def report_global_batch(self) -> None:
        """Say so when a resumed run's global batch, left out (--micro-batch-size x the
        data-parallel size, as in Megatron-LM), differs from the checkpoint's run's."""
        start, t = self.start, self.experiment.training
        if (start is None or start.weights_only
                or "global_batch_size" in self.experiment.given.get("training", {})):
            return
        saved = getattr(start.source.format.configs.get("training"), "global_batch_size", None)
        if saved is not None and saved != t.global_batch_size:
            print_rank_0(f"--global-batch-size left out: {t.global_batch_size} (--micro-batch-size "
                         f"{t.micro_batch_size} x the data-parallel size), the checkpoint's run "
                         f"had {saved}; pass --global-batch-size {saved} to continue it as it was")

    def report_padded_vocab(self) -> None:
        """Say so when the run keeps a checkpoint's embedding rows that differ from the
        vocabulary padded to --make-vocab-size-divisible-by."""
        m = self.experiment.model
        rows = m.padded_to_multiple()
        if self.start is not None and m.padded_vocab != rows:
            print_rank_0(f"vocabulary: keeping the checkpoint's {m.padded_vocab} embedding rows "
                         f"(--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} "
                         f"gives {rows})")

    def load(self, model, optimizer, scheduler) -> Optional[Tuple[int, Dict]]:
        """Restore :attr:`start` into the model (and optimizer and schedule unless
        --no-load-optim or fine-tuning). Returns (iteration, train state: consumed_samples,
        consumed_tokens and flops_so_far, None where the checkpoint has no such count) to
        continue from, or None when only weights were loaded (the run starts at iteration 0)."""
        start = self.start
        root, weights_only, flag = start.root, start.weights_only, start.flag
        iteration = start.source.iteration
        load_optim = not (self.cfg.no_load_optim or weights_only)
        o = self.experiment.optim
        mode = o.scheduler_mode()
        g = self.experiment.training.global_batch_size
        state = load_checkpoint(
            start.source, model,
            optimizer if load_optim else None, scheduler if load_optim else None,
            verify=not self.cfg.no_verify_checkpoint, scheduler_mode=mode,
            samples_per_iter=g, load_rng=not self.cfg.no_load_rng,
            fully_parallel=self.cfg.ckpt_fully_parallel_load)
        resumed = None
        if load_optim:
            resumed = iteration, state
        if weights_only:
            print_rank_0(f"fine-tuning from {flag} {root} iteration {iteration}: weights only; "
                         "iteration 0 with a fresh optimizer, schedule and random state")
        else:
            print_rank_0(f"loaded checkpoint {root} iteration {iteration}"
                         + ("" if load_optim else " (weights only)"))
        return resumed

    def _check_resumed_run(self, saved, has_run_config: bool, root: str) -> None:
        """A resume of --load: its checkpoint must be a run's to resume (a conversion from
        Hugging Face holds weights only), and a --pretrained-checkpoint given must be the
        one that run began from: the resume never reads it, so another one would be
        silently ignored. Refused rather than warned: the run would train from other
        weights than the command names, and the fix costs one flag. A run whose config
        records none (begun from scratch, or resumed without the flag) gets a note."""
        c, imported = self.cfg, saved["data"].imported_from
        if imported and not c.no_load_optim:
            raise ConfigError(
                f"--load {root}: a checkpoint converted from Hugging Face ({imported}) holds "
                f"weights only, no run to resume; start from it with --pretrained-checkpoint "
                f"{root} instead of --load")
        given = c.pretrained_checkpoint
        if not given or not has_run_config:
            return  # Megatron-LM's checkpoints record no starting point
        began = saved["checkpoint"].pretrained_checkpoint
        if began is None:
            print_rank_0(f"note: --pretrained-checkpoint {given} is not read: --load {root} "
                         "holds a run begun without it, and this run continues that one")
        elif began != given and os.path.realpath(began) != os.path.realpath(given):
            raise ConfigError(
                f"--load {root} holds a run begun from --pretrained-checkpoint {began}, not "
                f"{given}, and this run would continue it without reading {given}; pass "
                f"--pretrained-checkpoint {began} to continue it, or another --save (and "
                f"--load) to start a new run from {given}")

    def check_source(self, tokenizer) -> None:
        """Before any work: the checkpoint setup loads (:meth:`source`) must be of this
        model and tokenizer. Each architecture field that differs is named (the words a
        resume and ``--finetune`` share); a different tokenizer is refused naming both
        unless --allow-tokenizer-change. Records this run's tokenizer in its config."""
        data, mine = self.experiment.data, self.experiment.model
        identity = tokenizer_identity(tokenizer)
        start = self.start
        if start is None:
            return
        root, weights_only, flag = start.root, start.weights_only, start.flag
        saved = start.source.format.configs
        if flag == "--load" and not weights_only:
            self._check_resumed_run(saved, start.source.format.has_run_config, root)
        differ = architecture_differences(saved["model"], mine)
        earlier = earlier_record_fix(tokenizer, saved["data"].tokenizer_identity)
        if earlier and (differ or not self.cfg.allow_tokenizer_change):
            raise ConfigError(f"{flag} {root}: {earlier}")
        if differ:
            fix = ("pass the pretraining run's model flags (or its --model-preset)" if weights_only
                   else "pass the model flags the checkpoint was trained with "
                   "(or --use-checkpoint-args)")
            raise ConfigError(
                f"{flag} {root}: the checkpoint's model differs: {'; '.join(differ)}; {fix}")
        theirs, ours = saved["data"], data
        pinned = theirs.tokenizer_identity or _identity_of(saved)  # None: cannot be known
        if pinned is None:
            print_rank_0(f"note: {flag} {root} was saved before tokenizers were pinned and its "
                         f"tokenizer {theirs.tokenizer_model} cannot be read: this run's is not "
                         "checked against it")
            return
        if holds_same_ids(tokenizer, pinned):
            return
        ids_fix = other_ids_fix(tokenizer, pinned)
        if ids_fix and not self.cfg.allow_tokenizer_change:
            raise ConfigError(f"{flag} {root}: {ids_fix}")
        was = describe_tokenizer(theirs.tokenizer_type, saved["model"].vocab_size, pinned)
        now = describe_tokenizer(ours.tokenizer_type, tokenizer.vocab_size, identity)
        if self.cfg.allow_tokenizer_change:
            print_rank_0(
                f"tokenizer: {now} instead of the checkpoint's {was} (--allow-tokenizer-change)")
            return
        place = ours.tokenizer_model
        if place and theirs.tokenizer_model and _same_file(place, theirs.tokenizer_model):
            raise ConfigError(f"{flag} {root}: the tokenizer {place} changed since the checkpoint "
                              f"was trained (then {was}, now {now}); restore the file the run "
                              "trained with, or pass --allow-tokenizer-change to go on with "
                              "this one")
        raise ConfigError(
            f"{flag} {root}: the checkpoint was trained with tokenizer {was}, this run has {now}; "
            "pass the checkpoint's tokenizer flags (--use-checkpoint-args takes them from it), "
            "or --allow-tokenizer-change to go on with this one")

    def save(self, iteration: int, model, optimizer, scheduler, consumed_samples: int,
             consumed_tokens: Optional[int] = None, flops_so_far: float = 0.0) -> None:
        if not self.cfg.save:
            return
        self.finish_background()  # one save in flight: the one before is completed first
        self.check_lock_held()
        fully = self.cfg.dist_ckpt_optim_fully_reshardable
        # Megatron-LM's fields: it resumes, converts and reads --use-checkpoint-args from them
        common = {"args": megatron_lm_args(self.experiment, world_size=dist.get_world_size(),
                                           consumed_samples=consumed_samples,
                                           fully_reshardable=fully),
                  "checkpoint_version": CHECKPOINT_VERSION,
                  "num_floating_point_operations_so_far": float(flops_so_far)}
        t0 = time.time()
        data = self.experiment.data
        carried = (data.tokenizer_model if data.tokenizer_type == "HuggingFaceTokenizer"
                   else None)  # its files go with the weights (a moved tokenizer still loads)
        try:
            path = save_checkpoint(self.cfg.save, iteration, model, optimizer, scheduler,
                                   self.experiment.to_yaml(), {"consumed_samples": consumed_samples,
                                                               "consumed_tokens": consumed_tokens},
                                   run_id=self.run_id, extra_files=self.extra_files,
                                   tokenizer_dir=carried, common=common, fully_reshardable=fully,
                                   fully_parallel=self.cfg.ckpt_fully_parallel_save,
                                   background=self.background,
                                   before_complete=self.check_lock_held)
        except (Exception, CheckpointException) as err:  # torch's is a BaseException
            failure = _save_failure(err, self.cfg.save, iteration, self.run_id)
            if failure is None:
                raise
            raise failure from err
        if self.background is None:
            print_rank_0(f"saved checkpoint {path} in {time.time() - t0:.1f}s")
        else:
            print_rank_0(f"saving checkpoint {path} in the background (the loop waited "
                         f"{time.time() - t0:.1f}s)")

    def finish_background(self, wait: bool = True, after_error: bool = False) -> None:
        """Complete the save being written in the background once every rank's files are
        written (``wait``: wait for them); collective while one is pending. Raises
        CheckpointError when the writing failed; ``after_error`` (the run is stopping on
        an error already): prints it instead."""
        saves = self.background
        if saves is None or saves.pending is None:
            return
        t0, path = time.time(), saves.pending.path
        try:
            done = saves.finalize(blocking=False)
            if done is None and wait:
                done = saves.finalize(blocking=True)
                print_rank_0(f"waited {time.time() - t0:.1f}s for the background save of {path}")
        except CheckpointError as err:
            if not after_error:
                raise
            print(f"error: {err}", file=sys.stderr, flush=True)
            return
        if done is not None:
            print_rank_0(f"saved checkpoint {path} (written in the background in {done[1]:.1f}s)")

    def check_lock_held(self) -> None:
        """Collective: stop every rank (CheckpointError) when this run lost --save's lock to
        another run, before it writes anything there."""
        lost = [self.save_lock.lost() if self.save_lock is not None else None]
        dist.broadcast_object_list(lost, src=0)
        if lost[0]:  # release() at exit leaves the other run's file alone
            raise CheckpointError(lost[0])

    def close(self) -> None:
        if self.background is not None:  # before the lock: a worker may still write there
            abandoned = self.background.close()
            if abandoned:
                print_rank_0(abandoned)
        if self.save_lock is not None:
            self.save_lock.release()
