"""The training loop: megatron-core model, DDP, optimizer and schedules, with JREG metrics."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_jreg import cli
from megatron_jreg.strict_json import finite_or_null
from megatron_jreg.training.config import SECTIONS

TRACKER_NAME = "latest_checkpointed_iteration.txt"  # dist_checkpoint.TRACKER, without importing megatron


def log(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


class SignalFlag:
    """Records SIGTERM/SIGINT; the loop saves and exits at the end of the current step."""

    def __init__(self, enabled: bool):
        self.received: Optional[int] = None
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def model_flops_per_token(model_cfg, vocab: int) -> float:
    """Forward+backward FLOPs per token of the dense Llama model (6N plus attention)."""
    h, layers, s = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.seq_length
    kv = model_cfg.query_groups * (h // model_cfg.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * model_cfg.ffn_size
    return 6.0 * (layers * per_layer + h * vocab) + 12.0 * layers * h * s


def build_scheduler(optimizer, o, train_cfg):
    """megatron's OptimizerParamScheduler in its sample units (steps x global batch)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    g = train_cfg.global_batch_size
    decay_iters = o.lr_decay_iters or train_cfg.train_iters
    wsd = o.lr_wsd_decay_iters or max(1, decay_iters // 10)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if o.lr_warmup_iters else o.lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters * g, lr_decay_steps=decay_iters * g,
        lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
        wd_incr_steps=train_cfg.train_iters * g, wd_incr_style="constant",
        wsd_decay_steps=wsd * g if o.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style=o.lr_wsd_decay_style if o.lr_decay_style == "WSD" else None,
    )


class Trainer:
    def __init__(self, configs: Dict[str, object]):
        self.configs = configs
        self.model_cfg = configs["model"]
        self.parallel = configs["parallel"]
        self.jreg_cfg = configs["jreg"]
        self.optim_cfg = configs["optim"]
        self.train_cfg = configs["training"]
        self.data_cfg = configs["data"]
        self.ckpt_cfg = configs["checkpoint"]
        self.log_cfg = configs["logging"]
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_steps = 0
        self.save_lock = None
        self.run_id = "0"
        self.writer = None
        self.wandb = None

    # ---- setup ----------------------------------------------------------------------------
    def setup(self) -> None:
        from megatron.core import parallel_state

        from megatron_jreg.data.tokenizers import build_tokenizer
        from megatron_jreg.model.config import resolve_transformer_impl
        from megatron_jreg.distributed.setup import (
            initialize_distributed,
            initialize_model_parallel,
            seed_everything,
            use_cpu,
        )

        self._validate_before_work()
        self.tokenizer = build_tokenizer(self.data_cfg.tokenizer_type, self.data_cfg.tokenizer_model)
        if self.model_cfg.vocab_size is None:
            self.model_cfg.vocab_size = self.tokenizer.vocab_size
        elif self.model_cfg.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(
                f"--vocab-size {self.model_cfg.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}; drop --vocab-size to use the tokenizer's")
        initialize_distributed()
        self.device = torch.device("cpu") if use_cpu() else torch.device("cuda", torch.cuda.current_device())
        self._take_save_lock()
        impl, why = resolve_transformer_impl(self.model_cfg.transformer_impl)
        log(f"transformer implementation: {impl} ({why})")
        self.model_cfg.transformer_impl = impl  # the saved run config records what ran
        self._resolve_padded_vocab()
        initialize_model_parallel(self.model_cfg, self.parallel)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        per_step = self.train_cfg.micro_batch_size * self.dp_size
        if self.train_cfg.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size {self.train_cfg.global_batch_size} is not divisible by "
                f"--micro-batch-size x data-parallel size = {per_step}")
        self.num_microbatches = self.train_cfg.global_batch_size // per_step
        seed_everything(self.train_cfg.seed)
        self._build_model_and_optimizer()
        self._build_data()
        if self.ckpt_cfg.load:
            self._load()
        if self.log_cfg.tensorboard_dir and dist.get_rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.log_cfg.tensorboard_dir)
        if self.log_cfg.wandb_project and dist.get_rank() == 0:
            import wandb  # checked before any work

            self.wandb = wandb.init(project=self.log_cfg.wandb_project, name=self.log_cfg.wandb_exp_name,
                                    config=json.loads(json.dumps(self._config_dict(), default=str)))
        else:
            self.wandb = None
        self.signals = SignalFlag(self.train_cfg.exit_signal_handler)

    def _take_save_lock(self) -> None:
        """One writer per --save (rank 0 holds the lock for the job); every rank learns the
        outcome and the run id that names this run's temporary files."""
        from megatron_jreg.checkpoint.save_lock import SaveLock

        self.run_id, self.save_lock = "0", None
        if not self.ckpt_cfg.save:
            return
        outcome = [None, None, None]  # error, warning, run id
        if dist.get_rank() == 0:
            lock = SaveLock(self.ckpt_cfg.save)
            try:
                outcome[1] = lock.acquire()
                self.save_lock = lock
                outcome[2] = lock.run_id
                outcome[1] = "\n".join(filter(None, [outcome[1], self._clear_stale_saves()])) or None
            except (ValueError, OSError) as err:
                outcome[0] = (str(err) if isinstance(err, ValueError)
                              else f"--save {self.ckpt_cfg.save}: cannot write there ({err.strerror})")
        dist.broadcast_object_list(outcome, src=0)
        if outcome[0]:
            raise ValueError(outcome[0])
        if outcome[1]:
            log(outcome[1])
        self.run_id = outcome[2]

    def _clear_stale_saves(self) -> Optional[str]:
        """Holding the lock, no other run writes here: temporary save directories and
        tracker files left by killed runs are removed (they were never complete)."""
        import shutil

        root = self.ckpt_cfg.save
        stale = [n for n in os.listdir(root)
                 if (n.startswith("iter_") and (".partial" in n or ".replaced" in n))
                 or n.startswith(TRACKER_NAME + ".tmp")]
        for name in stale:
            path = os.path.join(root, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        return f"removed {len(stale)} unfinished save(s) of earlier runs: {', '.join(sorted(stale))}" if stale else None

    def _resolve_padded_vocab(self) -> None:
        """Embedding rows: a resumed checkpoint's own (so a checkpoint padded otherwise, e.g.
        by an earlier version that multiplied by TP, still loads), else the vocabulary
        padded to --make-vocab-size-divisible-by. Recorded in the saved run config."""
        from megatron_jreg.checkpoint.dist_checkpoint import (
            iteration_dir,
            resolve_iteration,
            saved_embedding_rows,
        )

        m = self.model_cfg
        m.padded_vocab = None
        rows = m.padded_vocab_size()
        if self.ckpt_cfg.load:
            path = iteration_dir(self.ckpt_cfg.load,
                                 resolve_iteration(self.ckpt_cfg.load, self.ckpt_cfg.ckpt_step))
            saved = saved_embedding_rows(path)
            tp = self.parallel.tensor_model_parallel_size
            if saved < m.vocab_size:
                raise ValueError(f"--load {self.ckpt_cfg.load}: the saved embedding has {saved} rows, "
                                 f"fewer than the tokenizer's {m.vocab_size}; wrong tokenizer or checkpoint")
            if saved % tp:
                raise ValueError(f"--load {self.ckpt_cfg.load}: the saved embedding has {saved} rows, "
                                 f"not divisible by --tensor-model-parallel-size {tp}; pick a TP that "
                                 "divides it")
            if saved != rows:
                log(f"vocabulary: keeping the checkpoint's {saved} embedding rows "
                    f"(--make-vocab-size-divisible-by {m.make_vocab_size_divisible_by} gives {rows})")
            rows = saved
        m.padded_vocab = rows

    def _validate_before_work(self) -> None:
        """Config errors that need no process group: fail before any work."""
        self.parallel.virtual_stages(self.model_cfg.num_layers)
        tp = self.parallel.tensor_model_parallel_size
        multiple = self.model_cfg.make_vocab_size_divisible_by
        if multiple % tp and not self.ckpt_cfg.load:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} does not divide --make-vocab-size-divisible-by "
                f"{multiple}: the vocabulary is padded to a multiple of it under every layout; "
                f"pass --make-vocab-size-divisible-by {multiple * tp // math.gcd(multiple, tp)}")
        if self.model_cfg.num_attention_heads % tp or self.model_cfg.query_groups % tp:
            raise ValueError(
                f"--tensor-model-parallel-size {tp} must divide --num-attention-heads "
                f"{self.model_cfg.num_attention_heads} and the query groups {self.model_cfg.query_groups}")
        if self.parallel.sequence_parallel and self.model_cfg.seq_length % tp:
            raise ValueError(f"--seq-length {self.model_cfg.seq_length} must be divisible by TP {tp} "
                             "under --sequence-parallel")
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world % (tp * self.parallel.pipeline_model_parallel_size):
            raise ValueError(f"{world} processes cannot hold TP {tp} x PP "
                             f"{self.parallel.pipeline_model_parallel_size}; launch a multiple")
        decay = self.optim_cfg.lr_decay_iters or self.train_cfg.train_iters
        if self.optim_cfg.lr_warmup_iters >= decay:
            raise ValueError(f"--lr-warmup-iters {self.optim_cfg.lr_warmup_iters} must be below the "
                             f"decay length {decay} (--lr-decay-iters, default --train-iters)")
        if self.ckpt_cfg.load and not os.path.isdir(self.ckpt_cfg.load):
            raise ValueError(f"--load {self.ckpt_cfg.load!r} does not exist")
        self._check_save_directory()
        if self.log_cfg.wandb_project:
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise ValueError("--wandb-project needs wandb installed: pip install wandb "
                                 "(or drop --wandb-project)")
        from megatron_jreg.data.gpt_datasets import check_indexed_dataset

        for prefix in self._data_prefixes():
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise ValueError(f"--data-path {prefix!r}: no {prefix}.bin/.idx; build it with "
                                 "tools/preprocess_data.py")
            check_indexed_dataset(prefix)  # .bin size as the .idx describes it, not empty

    def _check_save_directory(self) -> None:
        """A run that does not resume from --save must not replace the checkpoints there."""
        save, load = self.ckpt_cfg.save, self.ckpt_cfg.load
        if not save or not os.path.isdir(save) or self.ckpt_cfg.overwrite_checkpoints:
            return
        if load and os.path.realpath(load) == os.path.realpath(save):
            return
        held = sorted(n for n in os.listdir(save)
                      if n == TRACKER_NAME or (n.startswith("iter_") and n[5:].isdigit()))
        if held:
            shown = ", ".join(held[:3]) + (", ..." if len(held) > 3 else "")
            raise ValueError(
                f"--save {save} already holds checkpoints ({shown}) and this run does not resume "
                f"from them: pass --load {save} to continue that run, another --save for a new "
                "one, or --overwrite-checkpoints to replace them")

    def _data_prefixes(self) -> List[str]:
        items = self.data_cfg.data_path
        try:
            [float(x) for x in items[0::2]]
            return list(items[1::2]) if len(items) % 2 == 0 and len(items) > 1 else list(items)
        except ValueError:
            return list(items)

    def _build_model_and_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        from megatron_jreg.model.builder import build_model, transformer_config
        from megatron_jreg.model.init import layout_invariant_init
        from megatron_jreg.model.jreg_layer import JregTracker

        config = transformer_config(self.model_cfg, self.parallel)
        self.config = config
        self.tracker = JregTracker(self.jreg_cfg, self.model_cfg.num_layers,
                                   sequence_parallel=self.parallel.sequence_parallel)
        chunks = build_model(self.model_cfg, self.parallel, self.tracker, config)
        for chunk in chunks:
            chunk.to(self.device)
        # the same weights under every TP/PP layout of one seed (loads overwrite them)
        layout_invariant_init(chunks, self.train_cfg.seed, self.model_cfg.init_method_std,
                              self.model_cfg.num_layers)
        if self.model_cfg.bf16 or self.model_cfg.fp16:
            chunks = [Float16Module(config, chunk) for chunk in chunks]
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=self.model_cfg.bf16 or self.model_cfg.fp16,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.optim_cfg.use_distributed_optimizer,
        )
        self.model = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
                      for i, chunk in enumerate(chunks)]
        o = self.optim_cfg
        opt_config = OptimizerConfig(
            optimizer="adam", lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, bf16=self.model_cfg.bf16, fp16=self.model_cfg.fp16,
            params_dtype=config.params_dtype, initial_loss_scale=o.initial_loss_scale,
            use_distributed_optimizer=o.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(opt_config, self.model)
        self.scheduler = build_scheduler(self.optimizer, o, self.train_cfg)
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if len(self.model) > 1:
            config.no_sync_func = [m.no_sync for m in self.model]
        else:
            config.no_sync_func = self.model[0].no_sync
        self.num_params = sum(p.numel() for m in self.model for p in m.parameters())

    def _build_data(self) -> None:
        from megatron_jreg.data.gpt_datasets import GPTDataConfig, build_gpt_datasets

        g = self.train_cfg.global_batch_size
        evals = (self.train_cfg.train_iters // self.train_cfg.eval_interval + 1
                 if self.train_cfg.eval_interval else 0)
        data_config = GPTDataConfig(
            data_path=list(self.data_cfg.data_path), split=self.data_cfg.split,
            seq_length=self.model_cfg.seq_length, seed=self.train_cfg.seed,
            cache_dir=self.data_cfg.data_cache_path)
        # validation reuses one fixed set of eval_iters batches: comparable across runs
        valid_samples = self.train_cfg.eval_iters * g if evals else 0
        self.train_ds, self.valid_ds, _ = build_gpt_datasets(
            data_config, self.tokenizer, self.train_cfg.train_iters * g, valid_samples or None, None)
        if self.valid_ds is None and evals:
            log("warning: the --split gives no validation data; validation is off")

    # ---- data ---------------------------------------------------------------------------
    def _batches(self, dataset, start: int) -> List[Dict[str, torch.Tensor]]:
        """This DP rank's micro-batches of the global batch starting at sample ``start``
        (Megatron's pretraining sampler order: consecutive chunks of mbs x dp samples)."""
        mbs = self.train_cfg.micro_batch_size
        batches = []
        for j in range(self.num_microbatches):
            first = start + j * mbs * self.dp_size + self.dp_rank * mbs
            samples = [dataset[(first + k) % len(dataset)] for k in range(mbs)]
            batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples])
                     for key in ("tokens", "labels", "loss_mask", "position_ids", "token_mask")
                     if key in samples[0]}
            # JREG counts real tokens only; without padding every token counts (the fast path)
            if "token_mask" in batch and bool(batch["token_mask"].all()):
                del batch["token_mask"]
            batches.append({k: v.to(self.device, non_blocking=True) for k, v in batch.items()})
        return batches

    # ---- checkpoints ------------------------------------------------------------------------
    def _config_dict(self) -> Dict:
        import dataclasses

        return {k: dataclasses.asdict(v) for k, v in self.configs.items()}

    def _load(self) -> None:
        from megatron_jreg.checkpoint.dist_checkpoint import load_checkpoint

        load_optim = not self.ckpt_cfg.no_load_optim
        mode = self.optim_cfg.scheduler_mode()
        g = self.train_cfg.global_batch_size
        iteration, state = load_checkpoint(
            self.ckpt_cfg.load, self.ckpt_cfg.ckpt_step, self.model,
            self.optimizer if load_optim else None, self.scheduler if load_optim else None,
            verify=not self.ckpt_cfg.no_verify_checkpoint, scheduler_mode=mode,
            samples_per_iter=g, load_rng=not self.ckpt_cfg.no_load_rng)
        if load_optim:
            self.iteration = iteration
            self.consumed_samples = int(state.get("consumed_samples", 0))
            if mode == "checkpoint":  # the saved run config records the schedule that runs
                o, sch = self.optim_cfg, self.scheduler
                o.lr, o.min_lr, o.lr_decay_style = sch.max_lr, sch.min_lr, sch.lr_decay_style
                o.lr_warmup_iters, o.lr_decay_iters = sch.lr_warmup_steps // g, sch.lr_decay_steps // g
                o.weight_decay = sch.start_wd
                if sch.wsd_decay_steps:
                    o.lr_wsd_decay_iters = sch.wsd_decay_steps // g
                    o.lr_wsd_decay_style = sch.lr_wsd_decay_style
        log(f"loaded checkpoint {self.ckpt_cfg.load} iteration {iteration}"
            + ("" if load_optim else " (weights only)"))

    def save(self) -> None:
        from megatron_jreg.checkpoint.dist_checkpoint import save_checkpoint

        if not self.ckpt_cfg.save:
            return
        t0 = time.time()
        path = save_checkpoint(self.ckpt_cfg.save, self.iteration, self.model, self.optimizer,
                               self.scheduler, cli.to_yaml(self.configs),
                               {"consumed_samples": self.consumed_samples}, run_id=self.run_id)
        log(f"saved checkpoint {path} in {time.time() - t0:.1f}s")

    # ---- loop ---------------------------------------------------------------------------
    def _global_mean(self, value: Optional[float]) -> float:
        """The last stage's value, averaged over DP ranks, on every rank."""
        from megatron.core import parallel_state

        t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=parallel_state.get_pipeline_model_parallel_group())
        dist.all_reduce(t, group=parallel_state.get_data_parallel_group())
        return float(t.item()) / self.dp_size

    def train_step(self) -> Dict[str, float]:
        from megatron_jreg.training.step import forward_backward

        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        batches = self._batches(self.train_ds, self.consumed_samples)
        out = forward_backward(self.model, batches, self.model_cfg.seq_length,
                               self.train_cfg.micro_batch_size, self.tracker)
        loss = self._global_mean(out["lm_loss"])
        bad = [f"{name} is {value}" for name, value in (("LM loss", loss), ("JREG penalty", out["penalty"]))
               if not math.isfinite(value)]
        grad_norm = float("nan")
        success = False
        if not bad:
            success, grad_norm, bad = self._optimizer_step()
        if bad:
            if self.train_cfg.exit_on_nan:
                raise FloatingPointError(
                    f"iteration {self.iteration + 1}: {bad[0]}; no update was applied and nothing "
                    "saved. Lower --lr or check the data (or the checkpoint resumed from); "
                    "--no-exit-on-nan skips such steps instead")
            log(f"iteration {self.iteration + 1}: {bad[0]}; step skipped (no update)")
        if success:
            self.scheduler.step(increment=self.train_cfg.global_batch_size)
        self.iteration += 1
        self.consumed_samples += self.train_cfg.global_batch_size
        if not success:
            self.skipped_steps += 1
        return {"lm_loss": loss, "penalty": out["penalty"], "R": out["R"], "psi": out["psi"],
                "grad_norm": grad_norm, "skipped": not success}

    def _optimizer_step(self):
        """megatron's optimizer.step() in its parts, so that a non-finite gradient norm skips
        the update under bf16/fp32 too (megatron checks only fp16's loss-scaler overflow).
        Returns (updated, grad norm, [why a non-finite step was skipped])."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        if opt.prepare_grads():  # fp16: the loss scaler saw inf/NaN and lowered its scale
            return False, float("nan"), []
        grad_norm = float(opt.get_grad_norm())
        if not math.isfinite(grad_norm):
            return False, grad_norm, [f"gradient norm is {grad_norm}"]
        for part in getattr(opt, "chained_optimizers", [opt]):
            params = [] if getattr(part, "is_stub_optimizer", False) else part.get_parameters()
            if params and part.config.clip_grad > 0.0:
                clip_grad_by_total_norm_fp32(
                    params, max_norm=part.config.clip_grad, total_norm=grad_norm,
                    use_decoupled_grad=part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return opt.step_with_ready_grads(), grad_norm, []

    def evaluate(self) -> Optional[Dict[str, float]]:
        from megatron_jreg.training.step import forward_backward

        if self.valid_ds is None:
            return None
        for chunk in self.model:
            chunk.eval()
        losses, psis = [], []
        with torch.no_grad():
            for i in range(self.train_cfg.eval_iters):
                batches = self._batches(self.valid_ds, i * self.train_cfg.global_batch_size)
                out = forward_backward(self.model, batches, self.model_cfg.seq_length,
                                       self.train_cfg.micro_batch_size, self.tracker, forward_only=True)
                losses.append(self._global_mean(out["lm_loss"]))
                psis.append(out["psi"])
        for chunk in self.model:
            chunk.train()
        psi = [sum(col) / len(col) for col in zip(*psis)]
        return {"lm_loss": sum(losses) / len(losses), "psi": psi}

    def _memory_gib(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**30
        import psutil

        return psutil.Process().memory_info().rss / 2**30

    def _log(self, window: List[Dict], elapsed: float) -> None:
        from megatron_jreg.jreg import jump_rates

        n = len(window)
        loss = sum(w["lm_loss"] for w in window) / n
        penalty = sum(w["penalty"] for w in window) / n
        psi = [sum(col) / n for col in zip(*(w["psi"] for w in window))]
        rates = jump_rates(psi)
        L = self.model_cfg.num_layers
        zeta = {k: rates.get(L - d, 0.0) for d, k in ((0, "zeta_L"), (1, "zeta_L-1"), (2, "zeta_L-2"))}
        tokens = n * self.train_cfg.global_batch_size * self.model_cfg.seq_length
        tps = tokens / max(elapsed, 1e-9)
        lr = self.optimizer.param_groups[0]["lr"]
        grad_norm = window[-1]["grad_norm"]
        mem = self._memory_gib()
        line = (f"iteration {self.iteration:8d}/{self.train_cfg.train_iters} | consumed tokens "
                f"{self.consumed_samples * self.model_cfg.seq_length:12d} | lm loss {loss:.6f} | "
                f"jreg penalty {penalty:.6f} | zeta_L {zeta['zeta_L']:.3f} | lr {lr:.3e} | "
                f"grad norm {grad_norm:.3f} | tokens/s {tps:,.0f}")
        if self.device.type == "cuda":
            flops = (model_flops_per_token(self.model_cfg, self.model_cfg.padded_vocab_size())
                     * tps / dist.get_world_size())
            line += f" | TFLOP/s/GPU {flops / 1e12:.1f}"
        line += f" | mem {mem:.2f} GiB"
        skipped = sum(w["skipped"] for w in window)
        if skipped:
            line += f" | skipped {skipped}"
        log(line)
        if dist.get_rank() != 0:
            return
        record = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                  "lm_loss": loss, "jreg_penalty": penalty, "R": penalty / self.jreg_cfg.lam
                  if self.jreg_cfg.lam else sum(w["R"] for w in window) / n,
                  "psi": psi, "zeta_L": zeta["zeta_L"], "zeta_L-1": zeta["zeta_L-1"],
                  "zeta_L-2": zeta["zeta_L-2"], "lr": lr, "grad_norm": grad_norm,
                  "tokens_per_s": tps, "memory_gib": mem}
        if self.log_cfg.metrics_file:
            with open(self.log_cfg.metrics_file, "a") as f:
                f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
        scalars = {"lm loss": loss, "jreg/penalty": penalty, "jreg/R": record["R"],
                   "jreg/zeta_L": zeta["zeta_L"], "jreg/zeta_L-1": zeta["zeta_L-1"],
                   "jreg/zeta_L-2": zeta["zeta_L-2"], "learning-rate": lr, "grad-norm": grad_norm,
                   "throughput/tokens_per_s": tps, "memory/GiB": mem}
        scalars.update({f"jreg/psi/layer_{i + 1:02d}": p for i, p in enumerate(psi)})
        if self.writer:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, self.iteration)
            self.writer.flush()
        if self.wandb:
            self.wandb.log(scalars, step=self.iteration)

    def _log_eval(self, result: Dict) -> None:
        from megatron_jreg.jreg import jump_rates

        zeta = jump_rates(result["psi"]).get(self.model_cfg.num_layers, 0.0)
        log(f"validation at iteration {self.iteration} | lm loss {result['lm_loss']:.6f} | "
            f"ppl {math.exp(min(result['lm_loss'], 50)):.3f} | zeta_L {zeta:.3f}")
        if dist.get_rank() == 0:
            if self.writer:
                self.writer.add_scalar("validation/lm loss", result["lm_loss"], self.iteration)
                self.writer.add_scalar("validation/zeta_L", zeta, self.iteration)
            if self.log_cfg.metrics_file:
                with open(self.log_cfg.metrics_file, "a") as f:
                    f.write(json.dumps(finite_or_null(
                        {"iteration": self.iteration, "validation_lm_loss": result["lm_loss"],
                         "validation_psi": result["psi"], "validation_zeta_L": zeta}), allow_nan=False) + "\n")

    def train(self) -> int:
        t = self.train_cfg
        log(f"training {self.num_params / 1e6:.2f}M parameters on this rank, world "
            f"{dist.get_world_size()} (TP {self.parallel.tensor_model_parallel_size}, PP "
            f"{self.parallel.pipeline_model_parallel_size}, DP {self.dp_size}), "
            f"{self.num_microbatches} micro-batches per step, JREG lambda {self.jreg_cfg.lam}")
        window: List[Dict] = []
        start, t_start, first = time.time(), time.time(), self.iteration
        last_saved = self.iteration if self.ckpt_cfg.load else None
        last = None
        while self.iteration < t.train_iters:
            last = self.train_step()
            window.append(last)
            if self.iteration % self.log_cfg.log_interval == 0 or self.iteration == t.train_iters:
                self._log(window, time.time() - start)
                window, start = [], time.time()
            if t.eval_interval and self.iteration % t.eval_interval == 0:
                result = self.evaluate()
                if result:
                    self._log_eval(result)
            interval = self.ckpt_cfg.save_interval
            if interval and self.iteration % interval == 0:
                self.save()
                last_saved = self.iteration
            if self.signals.any_rank(self.device):
                log(f"signal received: saving at iteration {self.iteration} and exiting")
                if last_saved != self.iteration:
                    self.save()
                return 0
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                log(f"--exit-interval {t.exit_interval}: saving and exiting at iteration {self.iteration}")
                if last_saved != self.iteration:
                    self.save()
                return 0
        if last_saved != self.iteration:
            self.save()
        summary = f"done: {self.iteration - first} steps in {time.time() - t_start:.1f}s"
        if self.skipped_steps:
            summary += f" ({self.skipped_steps} skipped: non-finite loss, penalty or gradients)"
        if last is not None:
            summary += f", last lm loss {last['lm_loss']:.6f}, last jreg penalty {last['penalty']:.6f}"
        log(summary)
        return 0

    def close(self) -> None:
        if self.save_lock is not None:
            self.save_lock.release()
        if self.writer:
            self.writer.close()
        if self.wandb:
            self.wandb.finish()


def main(argv=None) -> int:
    from megatron_jreg.checkpoint.dist_checkpoint import CheckpointError
    from megatron_jreg.training.config import BUILDERS

    configs = cli.parse(SECTIONS, argv, description="Pretrain a Llama model with JREG on megatron-core",
                        build=BUILDERS)
    trainer = Trainer(configs)
    try:
        trainer.setup()
        code = trainer.train()
    except (ValueError, CheckpointError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except FloatingPointError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 3
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code
