"""The trainer's side of checkpoints: one writer per ``--save``, the vocabulary a resumed
checkpoint was padded to, resume and save. The format is ``megatron_jreg.checkpoint``'s."""

from __future__ import annotations

import os
import shutil
import time
from typing import Optional, Tuple

import torch.distributed as dist

from megatron_jreg.checkpoint.dist_checkpoint import (
    TRACKER,
    iteration_dir,
    load_checkpoint,
    resolve_iteration,
    save_checkpoint,
    saved_embedding_rows,
)
from megatron_jreg.checkpoint.save_lock import SaveLock
from megatron_jreg.distributed.setup import print_rank_0
from megatron_jreg.training.experiment import ExperimentConfig


class Checkpointer:
    """Loads and saves the run described by ``experiment`` (whose config each save records)."""

    def __init__(self, experiment: ExperimentConfig):
        self.experiment = experiment
        self.cfg = experiment.checkpoint
        self.save_lock: Optional[SaveLock] = None
        self.run_id = "0"

    def take_save_lock(self) -> None:
        """One writer per --save (rank 0 holds the lock for the job); every rank learns the
        outcome and the run id that names this run's temporary files."""
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
                outcome[1] = "\n".join(filter(None, [outcome[1], self._clear_stale_saves()])) or None
            except (ValueError, OSError) as err:
                outcome[0] = (str(err) if isinstance(err, ValueError)
                              else f"--save {self.cfg.save}: cannot write there ({err.strerror})")
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise ValueError(outcome[0])
        if outcome[1]:
            print_rank_0(outcome[1])
        self.run_id = outcome[2]

    def _clear_stale_saves(self) -> Optional[str]:
        """Holding the lock, no other run writes here: temporary save directories and
        tracker files left by killed runs are removed (they were never complete)."""
        root = self.cfg.save
        stale = [n for n in os.listdir(root)
                 if (n.startswith("iter_") and (".partial" in n or ".replaced" in n))
                 or n.startswith(TRACKER + ".tmp")]
        for name in stale:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return f"removed {len(stale)} unfinished save(s) of earlier runs: {', '.join(sorted(stale))}" if stale else None

    def resolve_padded_vocab(self) -> None:
        """Embedding rows: a resumed checkpoint's own (so a checkpoint padded otherwise, e.g.
        by an earlier version that multiplied by TP, still loads), else the vocabulary
        padded to --make-vocab-size-divisible-by. Recorded in the saved run config."""
        m = self.experiment.model
        m.padded_vocab = None
        rows = m.padded_vocab_size()
        if self.cfg.load:
            path = iteration_dir(self.cfg.load, resolve_iteration(self.cfg.load, self.cfg.ckpt_step))
            saved = saved_embedding_rows(path)
            tp = self.experiment.parallel.tensor_model_parallel_size
            if saved < m.vocab_size:
                raise ValueError(f"--load {self.cfg.load}: the saved embedding has {saved} rows, "
                                 f"fewer than the tokenizer's {m.vocab_size}; wrong tokenizer or checkpoint")
            if saved % tp:
                raise ValueError(f"--load {self.cfg.load}: the saved embedding has {saved} rows, "
                                 f"not divisible by --tensor-model-parallel-size {tp}; pick a TP that "
                                 "divides it")
            if saved != rows:
                print_rank_0(f"vocabulary: keeping the checkpoint's {saved} embedding rows "
                             f"(--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} gives {rows})")
            rows = saved
        m.padded_vocab = rows

    def load(self, model, optimizer, scheduler) -> Optional[Tuple[int, int]]:
        """Restore --load into the model (and optimizer and schedule unless
        --no-load-optim). Returns (iteration, consumed samples) to continue from, or None
        when only weights were loaded."""
        load_optim = not self.cfg.no_load_optim
        o = self.experiment.optim
        mode = o.scheduler_mode()
        g = self.experiment.training.global_batch_size
        iteration, state = load_checkpoint(
            self.cfg.load, self.cfg.ckpt_step, model,
            optimizer if load_optim else None, scheduler if load_optim else None,
            verify=not self.cfg.no_verify_checkpoint, scheduler_mode=mode,
            samples_per_iter=g, load_rng=not self.cfg.no_load_rng)
        resumed = None
        if load_optim:
            resumed = iteration, int(state.get("consumed_samples", 0))
            if mode == "checkpoint":  # the saved run config records the schedule that runs
                sch = scheduler
                o.lr, o.min_lr, o.lr_decay_style = sch.max_lr, sch.min_lr, sch.lr_decay_style
                o.lr_warmup_iters, o.lr_decay_iters = sch.lr_warmup_steps // g, sch.lr_decay_steps // g
                o.weight_decay = sch.start_wd
                if sch.wsd_decay_steps:
                    o.lr_wsd_decay_iters = sch.wsd_decay_steps // g
                    o.lr_wsd_decay_style = sch.lr_wsd_decay_style
        print_rank_0(f"loaded checkpoint {self.cfg.load} iteration {iteration}"
                     + ("" if load_optim else " (weights only)"))
        return resumed

    def save(self, iteration: int, model, optimizer, scheduler, consumed_samples: int) -> None:
        if not self.cfg.save:
            return
        t0 = time.time()
        path = save_checkpoint(self.cfg.save, iteration, model, optimizer, scheduler,
                               self.experiment.to_yaml(), {"consumed_samples": consumed_samples},
                               run_id=self.run_id)
        print_rank_0(f"saved checkpoint {path} in {time.time() - t0:.1f}s")

    def close(self) -> None:
        if self.save_lock is not None:
            self.save_lock.release()
