"""The training loop (``Trainer``, ``run``): model, DDP, optimizer, schedules and JREG metrics."""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.transformer.module import Float16Module

from megatron_jreg.checkpoint.dist_checkpoint import CHAT_TEMPLATE
from megatron_jreg.checkpoint.faults import phrase
from megatron_jreg.config.megatron_lm import notes
from megatron_jreg.config.model import resolve_attention_backend, resolve_transformer_impl
from megatron_jreg.config.resolve import RunFacts, resolve
from megatron_jreg.data.datasets.batches import rank_microbatches
from megatron_jreg.data.datasets.gpt import build_gpt_datasets
from megatron_jreg.data.datasets.run_data_check import check_data_against_run
from megatron_jreg.data.datasets.sample_order import CyclicOrder
from megatron_jreg.data.datasets.sft_samples import build_sft_samples
from megatron_jreg.data.tokenizers.build import tokenizer_identity
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    print_rank_0,
    seed_everything,
    teardown,
)
from megatron_jreg.errors import ConfigError, UserError
from megatron_jreg.model.builder import build_model, decide_fusions, transformer_config
from megatron_jreg.model.init import layout_invariant_init
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.ops.displacement import describe_impl, fused_available, kernel_build
from megatron_jreg.platform import device as platform_device
from megatron_jreg.training import data_parallel
from megatron_jreg.training.checkpointing import Checkpointer
from megatron_jreg.training.experiment import ExperimentConfig
from megatron_jreg.training.metrics import (
    TRAIN,
    VALIDATION,
    MetricsLogger,
    build_metrics_logger,
    jreg_summary,
    model_flops_per_token,
    run_summary,
    validation_summary,
)
from megatron_jreg.training.model_fit import model_fit
from megatron_jreg.training.optimizer import build_optimizer, build_scheduler, optimizer_step
from megatron_jreg.training.outputs import check_outputs
from megatron_jreg.training.signals import SignalFlag
from megatron_jreg.training.source import run_tokenizer, starting_point
from megatron_jreg.training.step import forward_backward
from megatron_jreg.training.window import reduce_window


class Trainer:
    def __init__(self, experiment: ExperimentConfig):
        self.cfg = experiment
        self.train_cfg = experiment.training  # steps, batches, evaluation: read every step
        self.iteration = 0
        self.consumed_samples = self.consumed_tokens = 0  # tokens counted (--seq-length may change)
        self.flops_so_far = 0.0  # model FLOPs of the steps taken (Megatron-LM's running total)
        self.skipped_steps = self.no_loss_token_steps = 0
        self.checkpoints = Checkpointer(experiment)
        self.metrics = MetricsLogger()
        self.started = time.time()  # --exit-duration-in-mins counts from here

    # ---- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        # the plan: the settings, the checkpoint the run starts from (read once) and the
        # tokenizer resolve into the run, which nothing changes afterwards
        # --save's lock first: its lineage and the checkpoint the run continues are judged
        # by the one run that holds it, so no other run saves between the two
        initialize_distributed(self.cfg.parallel.distributed_timeout_minutes)
        self.checkpoints.take_save_lock()
        self.checkpoints.start = starting_point(self.cfg.checkpoint, self.cfg.start)
        if self.checkpoints.start is None and self.cfg.checkpoint.load:
            print_rank_0(f"--load {self.cfg.checkpoint.load}: no checkpoint there yet (it is this "
                         "run's --save); starting from scratch")
        self.tokenizer, model = run_tokenizer(self.cfg.data, self.cfg.model)
        raw = dataclasses.replace(self.cfg, model=model)
        self.checkpoints.check_source(self.tokenizer)  # first: a new tokenizer explains the rest
        raw.validate(tokenizer_vocab_size=self.tokenizer.vocab_size)
        impl, impl_why = resolve_transformer_impl(raw.model.transformer_impl)
        cfg = self.cfg = resolve(raw, RunFacts(
            tokenizer_vocab_size=self.tokenizer.vocab_size,
            tokenizer_identity=tokenizer_identity(self.tokenizer), transformer_impl=impl,
            **self.checkpoints.facts()))
        self.train_cfg = cfg.training
        self.checkpoints.experiment = cfg  # each save records the resolved run
        misfit = model_fit(cfg)
        if misfit is not None and misfit.weights_alone:  # no build of it can finish
            raise ConfigError(misfit.line)
        self.device = platform_device.current_device()
        check_outputs(self.cfg.outputs())
        check_data_against_run(cfg.data_prefixes(), self.tokenizer.vocab_size,
                               cfg.data.data_cache_path,
                               (cfg.data.split, cfg.model.seq_length) if cfg.data.sft else None)
        if cfg.jreg.impl == "fused" and not fused_available(self.device):
            raise ConfigError(
                f"--jreg-impl fused: the fused kernel is not built for {self.device.type} "
                f"({kernel_build()}); reinstall with `pip install --no-build-isolation -e .` "
                "or pass --jreg-impl torch (or auto)")
        jreg_impl, why = describe_impl(cfg.jreg.impl, self.device)
        print_rank_0(f"JREG implementation: {jreg_impl} ({why})")
        print_rank_0(f"transformer implementation: {impl} ({impl_why})")
        attention, why = resolve_attention_backend(cfg.model.attention_backend, impl)
        print_rank_0(f"core attention: {attention} ({why})")
        self.fusions = decide_fusions(cfg.model, cfg.megatron_lm)  # "rope fusion: on (why)", ...
        print_rank_0("\n".join(self.fusions.lines()))
        # the Megatron-LM flags, with the padding the settings asked for (a checkpoint's own
        # rows have a line of their own)
        asked = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, padded_vocab=raw.model.padded_vocab))
        for line in notes(asked, cfg.given, impl, platform_device.backend()):
            print_rank_0(line)
        self.checkpoints.report_padded_vocab()
        self.checkpoints.report_global_batch()
        initialize_model_parallel(cfg.model, cfg.parallel)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        t = self.train_cfg
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * self.dp_size)
        # whether a global batch can lack loss tokens (then each step counts them first)
        self._count_loss_tokens = cfg.data.sft or cfg.data.eod_mask_loss
        seed_everything(self.train_cfg.seed)
        self._build_model_and_optimizer()
        self._build_data()
        if self.checkpoints.start is not None:
            resumed = self.checkpoints.load(self.model, self.optimizer, self.scheduler)
            if resumed is None:  # weights only: the fp32 main params hold the pre-load weights
                self.optimizer.reload_model_params()  # (as Megatron-LM does after such a load)
            else:
                self.iteration, state = resumed
                self.consumed_samples = state["consumed_samples"]
                tokens, flops = state["consumed_tokens"], state["flops_so_far"]  # None: not saved
                self.consumed_tokens = (self.consumed_samples * cfg.model.seq_length
                                        if tokens is None else tokens)
                self.flops_so_far = (self.consumed_tokens * self._flops_per_token()
                                     if flops is None else flops)
        self.metrics = build_metrics_logger(cfg.logging, self.train_cfg.train_iters,
                                            dist.get_rank(), cfg.to_dict(), cfg.wandb_dir())
        self.signals = SignalFlag(self.train_cfg.exit_signal_handler,
                                  extra=(getattr(signal, self.train_cfg.exit_signal),))

    def _build_model_and_optimizer(self) -> None:
        cfg = self.cfg
        config = transformer_config(cfg.model, cfg.parallel, self.fusions)
        self.tracker = JregTracker(cfg.jreg, cfg.model.num_layers,
                                   sequence_parallel=cfg.parallel.sequence_parallel)
        chunks = build_model(cfg.model, cfg.parallel, self.tracker, config, self.fusions)
        for chunk in chunks:
            chunk.to(self.device)
        if self.checkpoints.start is None:  # a load sets every weight: no 20-30 s draw at 3B
            layout_invariant_init(chunks, self.train_cfg.seed, cfg.model.init_method_std,
                                  cfg.model.num_layers)
        if cfg.model.bf16 or cfg.model.fp16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        self.model = data_parallel.wrap(chunks, config, cfg)
        self.optimizer = build_optimizer(self.model, config, cfg.model, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.train_cfg)
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        self.num_params = sum(p.numel() for m in self.model for p in m.parameters())

    def _build_data(self) -> None:
        t = self.train_cfg
        g = t.global_batch_size
        evals = t.train_iters // t.eval_interval + 1 if t.eval_interval and t.eval_iters else 0
        # validation reuses one fixed set of eval_iters batches: comparable across runs
        valid_samples = t.eval_iters * g if evals else 0
        if self.cfg.data.sft:
            self.train_ds, self.valid_ds, waste = build_sft_samples(
                self.cfg.data_prefixes(), self.cfg.data.split, self.cfg.model.seq_length,
                t.seed, t.train_iters * g, valid_samples, self.tokenizer.eod)
            template = self.train_ds.datasets[0].chat_template
            if template:  # the HF export writes it into tokenizer_config.json
                self.checkpoints.extra_files[CHAT_TEMPLATE] = template
            print_rank_0(f"SFT data: one conversation per sample, padded to --seq-length "
                         f"{self.cfg.model.seq_length}: {100 * waste:.1f}% of the train split's "
                         "token positions are padding")
        else:
            self.train_ds, self.valid_ds, _ = build_gpt_datasets(
                self.cfg.gpt_data_config(), self.tokenizer, t.train_iters * g,
                valid_samples or None, None)
        no_valid = "the --split gives no validation data"
        if self.cfg.data.sft and self.valid_ds is not None and not self.valid_ds.has_loss_token():
            self.valid_ds = None  # its every batch would be skipped: a loss that is never there
            no_valid = (f"no conversation of the validation split has a loss token within "
                        f"--seq-length {self.cfg.model.seq_length}")
        if self.valid_ds is None and evals:
            print_rank_0(f"warning: {no_valid}; validation is off")
        if self.cfg.data.dataloader_type == "cyclic":
            self.train_ds = CyclicOrder(self.train_ds, t.micro_batch_size, self.dp_size)

    def _batches(self, dataset, start: int) -> List[Dict[str, torch.Tensor]]:
        return rank_microbatches(dataset, start, self.train_cfg.micro_batch_size,
                                 self.num_microbatches, self.dp_rank, self.dp_size, self.device)

    # ---- steps ----------------------------------------------------------------------------
    def train_step(self) -> Dict[str, object]:
        """One step. Nothing in it waits for the device but the gradient norm (clipping and
        the skip of a non-finite step need it): the LM loss and the JREG sums stay on the
        device until the window they belong to is logged (``window.reduce_window``), except
        when a step is not applied, whose loss and penalty are then read to name why."""
        t = self.train_cfg
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = self._batches(self.train_ds, self.consumed_samples)
        out = forward_backward(self.model, batches, self.cfg.model.seq_length, t.micro_batch_size,
                               self.tracker, per_token_loss=self.cfg.per_token_loss(),
                               count_loss_tokens=self._count_loss_tokens, reduce_metrics=False)
        empty = out["no_loss_tokens"]  # no loss token in the global batch: nothing ran, no update
        step = {"lm_loss": out["lm_loss"], "jreg_stats": out.get("jreg_stats"), "grad_norm": None,
                "skipped": True, "no_loss_tokens": empty, "penalty": None, "R": None, "psi": None}
        success, bad = False, []
        if not empty:
            success, grad_norm, bad = optimizer_step(self.optimizer)
            if success:
                step["grad_norm"] = grad_norm  # never a NaN shown as a number
            else:  # every rank takes this branch: the norm and the loss scaler's check are global
                reduce_window([step], self.tracker, self.dp_size)
                bad = [f"{name} is {value}" for name, value in (
                    ("LM loss", step["lm_loss"]), ("JREG penalty", step["penalty"]))
                    if not math.isfinite(value)] or bad
        if bad:
            if t.exit_on_nan:
                raise FloatingPointError(
                    f"iteration {self.iteration + 1}: {bad[0]}; no update was applied and nothing "
                    "saved. Lower --lr or check the data (or the checkpoint resumed from); "
                    "--no-exit-on-nan skips such steps instead")
            print_rank_0(f"iteration {self.iteration + 1}: {bad[0]}; step skipped (no update)")
        if success or empty:  # an empty batch was consumed: the schedule counts it
            self.scheduler.step(increment=t.global_batch_size)
        self.iteration += 1
        self.consumed_samples += t.global_batch_size
        self.consumed_tokens += t.global_batch_size * self.cfg.model.seq_length
        self.flops_so_far += (t.global_batch_size * self.cfg.model.seq_length
                              * self._flops_per_token())
        self.skipped_steps += not success
        self.no_loss_token_steps += empty
        step["skipped"] = not success
        return step

    def evaluate(self) -> Optional[Dict[str, object]]:
        """Validation LM loss and Psi over the fixed eval_iters batches (collective)."""
        t = self.train_cfg
        if self.valid_ds is None:
            return None
        data_parallel.sync_params(self.model)
        for chunk in self.model:
            chunk.eval()
        batches_read = []  # a batch without a loss token has no loss (0/0): left out
        with torch.no_grad():
            for i in range(t.eval_iters):
                batches = self._batches(self.valid_ds, i * t.global_batch_size)
                out = forward_backward(self.model, batches, self.cfg.model.seq_length,
                                       t.micro_batch_size, self.tracker, forward_only=True,
                                       per_token_loss=self.cfg.per_token_loss(),
                                       reduce_metrics=False)
                if not out["no_loss_tokens"]:
                    batches_read.append(dict(out))
        for chunk in self.model:
            chunk.train()
        reduce_window(batches_read, self.tracker, self.dp_size)  # one read for every batch
        losses = [b["lm_loss"] for b in batches_read]
        psi = [sum(col) / len(col) for col in zip(*(b["psi"] for b in batches_read))]
        return validation_summary(sum(losses) / len(losses) if losses else None, psi,
                                  self.cfg.model.num_layers)

    def _log_window(self, window: List[Dict], elapsed: float, outside: Dict[str, float]) -> None:
        """Log the steps of ``window``: ``elapsed`` seconds of training steps (tokens/s counts these
        only); ``outside``: the seconds of evaluation and saving within the window, logged apart."""
        cfg = self.cfg
        reduce_window(window, self.tracker, self.dp_size)
        values = jreg_summary(window, cfg.model.num_layers, cfg.jreg.lam)
        tokens = len(window) * self.train_cfg.global_batch_size * cfg.model.seq_length
        tps = tokens / max(elapsed, 1e-9)
        tflops = self._flops_per_token() * tps / dist.get_world_size() / 1e12
        skipped = sum(w["skipped"] for w in window)
        values.update(consumed_samples=self.consumed_samples,
                      consumed_tokens=self.consumed_tokens,
                      lr=self.optimizer.param_groups[0]["lr"], grad_norm=window[-1]["grad_norm"],
                      tokens_per_s=tps, tflops_per_gpu=tflops,
                      memory_gib=platform_device.peak_memory_gib(self.device),
                      skipped=skipped or None, eval_seconds=outside.get("eval") or None,
                      save_seconds=outside.get("save") or None)
        self.metrics.log(TRAIN, self.iteration, values)

    def _flops_per_token(self) -> float:
        return model_flops_per_token(self.cfg.model, self.cfg.model.padded_vocab_size())

    # ---- loop -----------------------------------------------------------------------------
    def save(self) -> None:
        data_parallel.sync_params(self.model)
        self.checkpoints.save(self.iteration, self.model, self.optimizer, self.scheduler,
                              self.consumed_samples, self.consumed_tokens, self.flops_so_far)

    def train(self) -> int:
        cfg, t, p = self.cfg, self.train_cfg, self.cfg.parallel
        cp = f"CP {p.context_parallel_size}, " if p.context_parallel_size > 1 else ""
        print_rank_0(
            f"training {self.num_params / 1e6:.2f}M parameters on this rank, "
            f"world {dist.get_world_size()} (TP {p.tensor_model_parallel_size}, "
            f"PP {p.pipeline_model_parallel_size}, {cp}DP {self.dp_size}), "
            f"{self.num_microbatches} micro-batches per step, JREG lambda {cfg.jreg.lam}")
        window: List[Dict] = []
        # the window's wall time less its evaluations and saves (``outside``, logged apart)
        # is what tokens/s divides by
        start, t_start, first = time.time(), time.time(), self.iteration
        outside = {"eval": 0.0, "save": 0.0}
        last_saved = self.iteration if self.iteration else None
        last = None
        while self.iteration < t.train_iters:
            saves = self.checkpoints.background
            if saves is not None and saves.pending is not None:
                t0 = time.time()
                self.checkpoints.finish_background(wait=False)  # a background save written by now
                outside["save"] += time.time() - t0
            last = self.train_step()
            window.append(last)
            if self.iteration % cfg.logging.log_interval == 0 or self.iteration == t.train_iters:
                self._log_window(window, time.time() - start - sum(outside.values()), outside)
                window, start, outside = [], time.time(), {"eval": 0.0, "save": 0.0}
            if t.eval_interval and t.eval_iters and self.iteration % t.eval_interval == 0:
                t0 = time.time()
                result = self.evaluate()
                if result:
                    result["seconds"] = time.time() - t0
                    self.metrics.log(VALIDATION, self.iteration, result)
                outside["eval"] += time.time() - t0
            interval = cfg.checkpoint.save_interval
            if interval and self.iteration % interval == 0:
                t0 = time.time()
                self.save()
                outside["save"] += time.time() - t0
                last_saved = self.iteration
            reason = self.signals.stop_reason(self.device, self.iteration, self._time_is_up(),
                                              at_save=last_saved == self.iteration)
            if reason:
                why = "signal received" if reason == "signal" else (
                    f"--exit-duration-in-mins {t.exit_duration_in_mins} reached")
                print_rank_0(f"{why}: saving at iteration {self.iteration} and exiting")
                if last_saved != self.iteration:
                    self.save()
                return 0
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                print_rank_0(f"--exit-interval {t.exit_interval}: saving and exiting at iteration "
                             f"{self.iteration}")
                if last_saved != self.iteration:
                    self.save()
                return 0
        if last_saved != self.iteration:
            t0 = time.time()
            self.save()
            outside["save"] += time.time() - t0
        after = ", ".join(f"{kind} {seconds:.1f}s" for kind, seconds in outside.items() if seconds)
        print_rank_0(run_summary(self.iteration - first, time.time() - t_start, self.skipped_steps,
                                 self.no_loss_token_steps, last)
                     + (f" (after the last logged step: {after})" if after else ""))
        return 0

    def _time_is_up(self) -> bool:
        limit = self.train_cfg.exit_duration_in_mins
        return limit is not None and (time.time() - self.started) / 60 > limit

    def close(self) -> None:
        self.checkpoints.close()
        self.metrics.close()


def run(experiment: ExperimentConfig) -> int:
    """Set up and train a parsed experiment (``megatron_jreg.train.main``). Exit 2 on a user error
    (a setting, an input, a checkpoint: ``errors.UserError``) or a missing file, 3 on a non-finite
    step (with --exit-on-nan); any other exception is a bug and keeps its traceback."""
    trainer = Trainer(experiment)
    try:
        trainer.setup()
        code = trainer.train()
        trainer.checkpoints.finish_background()  # the last save is whole before the exit
    except (UserError, FileNotFoundError) as err:  # anything else keeps its traceback
        print(f"error: {phrase(err, trainer.checkpoints.wording)}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        trainer.checkpoints.finish_background(after_error=True)  # its steps before were fine
        return 3
    finally:
        trainer.close()
        teardown()  # also after an error
    return code
