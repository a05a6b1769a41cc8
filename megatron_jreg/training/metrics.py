"""What a run reports, under one vocabulary (:data:`METRICS`), and the sinks that write it: the
JSONL metrics file, TensorBoard, W&B and the console line, each under its own names.

A record is ``(phase, iteration, values)``. A value of None was not measured and every sink
leaves it out, except the LM loss, which the JSONL file writes as null (a step with no loss
token). Each JSONL line carries the run's ``run_id``, so runs sharing a ``--metrics-file`` stay
apart.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_jreg.distributed.setup import print_rank_0
from megatron_jreg.errors import InputError
from megatron_jreg.jreg import jump_rates
from megatron_jreg.strict_json import finite_or_null

TRAIN, VALIDATION = "train", "validation"


@dataclass(frozen=True)
class Metric:
    """One quantity and its name in each sink (None: that sink does not show it)."""

    key: str  # internal name, the key of a record's values
    jsonl: Optional[str] = None
    tensorboard: Optional[str] = None  # also the W&B key; "{layer:02d}" expands a per-layer list
    console: Optional[str] = None  # label and format in the console line
    null_in_jsonl: bool = False  # None is written as null (not left out) in the JSONL file


# The one table of names. Order is the order of the JSONL keys and of the console line.
METRICS: Dict[str, Sequence[Metric]] = {
    TRAIN: (
        Metric("consumed_samples", jsonl="consumed_samples"),
        Metric("consumed_tokens", console="consumed tokens {:12d}"),
        Metric("lm_loss", jsonl="lm_loss", tensorboard="lm loss", console="lm loss {:.6f}",
               null_in_jsonl=True),
        Metric("jreg_penalty", jsonl="jreg_penalty", tensorboard="jreg/penalty",
               console="jreg penalty {:.6f}"),
        Metric("R", jsonl="R", tensorboard="jreg/R"),
        Metric("psi", jsonl="psi", tensorboard="jreg/psi/layer_{layer:02d}"),
        Metric("zeta_L", jsonl="zeta_L", tensorboard="jreg/zeta_L", console="zeta_L {:.3f}"),
        Metric("zeta_L-1", jsonl="zeta_L-1", tensorboard="jreg/zeta_L-1"),
        Metric("zeta_L-2", jsonl="zeta_L-2", tensorboard="jreg/zeta_L-2"),
        Metric("lr", jsonl="lr", tensorboard="learning-rate", console="lr {:.3e}"),
        Metric("grad_norm", jsonl="grad_norm", tensorboard="grad-norm", console="grad norm {:.3f}"),
        Metric("tokens_per_s", jsonl="tokens_per_s", tensorboard="throughput/tokens_per_s",
               console="tokens/s {:,.0f}"),
        Metric("tflops_per_gpu", console="TFLOP/s/GPU {:.1f}"),
        Metric("memory_gib", jsonl="memory_gib", tensorboard="memory/GiB",
               console="mem {:.2f} GiB"),
        Metric("skipped", console="skipped {}"),
        # seconds of the window spent evaluating and saving: not in tokens/s
        Metric("eval_seconds", jsonl="eval_seconds", tensorboard="time/eval_seconds",
               console="eval {:.1f}s"),
        Metric("save_seconds", jsonl="save_seconds", tensorboard="time/save_seconds",
               console="save {:.1f}s"),
    ),
    VALIDATION: (
        Metric("lm_loss", jsonl="validation_lm_loss", tensorboard="validation/lm loss",
               console="lm loss {:.6f}", null_in_jsonl=True),
        Metric("ppl", console="ppl {:.3f}"),
        Metric("psi", jsonl="validation_psi"),
        Metric("zeta_L", jsonl="validation_zeta_L", tensorboard="validation/zeta_L",
               console="zeta_L {:.3f}"),
        Metric("seconds", jsonl="validation_seconds", tensorboard="time/validation_seconds",
               console="{:.1f}s"),
    ),
}


def _present(phase: str, values: Dict[str, object]):
    return [(m, values[m.key]) for m in METRICS[phase] if values.get(m.key) is not None]


def scalars(phase: str, values: Dict[str, object]) -> Dict[str, float]:
    """{TensorBoard/W&B tag: value}, per-layer lists expanded to one tag per layer."""
    out: Dict[str, float] = {}
    for metric, value in _present(phase, values):
        if metric.tensorboard is None:
            continue
        if isinstance(value, (list, tuple)):
            out.update({metric.tensorboard.format(layer=i + 1): v for i, v in enumerate(value)})
        else:
            out[metric.tensorboard] = value
    return out


class ConsoleSink:
    """``iteration N/T | lm loss ... | ...`` and ``validation at iteration N | ...`` on rank 0."""

    def __init__(self, train_iters: int):
        self.train_iters = train_iters

    def write(self, phase: str, iteration: int, values: Dict[str, object]) -> None:
        head = (f"iteration {iteration:8d}/{self.train_iters}" if phase == TRAIN
                else f"validation at iteration {iteration}")
        parts = [m.console.format(v) for m, v in _present(phase, values) if m.console]
        print_rank_0(" | ".join([head] + parts))

    def close(self) -> None:
        pass


# Bytes read from the end of an existing --metrics-file: its last record is far shorter.
METRICS_TAIL_BYTES = 1 << 16


def existing_metrics_file(path: str):
    """(error, note) for appending to ``path``: an error when it exists, is not empty and its
    last line is not a JSON object (a dataset .bin, a log: appending would damage it); a
    note when it holds an earlier run's records (a resumed run appends to them)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return None, None  # no file yet (a directory or a bad path is refused before)
    if size == 0:
        return None, None
    try:
        with open(path, "rb") as f:
            f.seek(max(0, size - METRICS_TAIL_BYTES))
            tail = f.read()
    except OSError as err:
        return f"--metrics-file {path}: cannot read it ({err.strerror}); choose another file", None
    lines = tail.rstrip(b"\n").split(b"\n")
    try:
        last = json.loads(lines[-1].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        last = None
    if not isinstance(last, dict):
        return (f"--metrics-file {path}: exists and is not a JSON-lines metrics file "
                f"({size} bytes); records are appended to it, so choose another file"), None
    return None, f"--metrics-file {path}: appending to the {size} bytes of records already there"


class JsonlSink:
    """One strict-JSON object per record (non-finite numbers as null), appended; with
    ``run_id``, the record's last key names the run."""

    def __init__(self, path: str, run_id: Optional[str] = None):
        self.path = path
        self.run_id = run_id

    def write(self, phase: str, iteration: int, values: Dict[str, object]) -> None:
        record = {"iteration": iteration}
        record.update({m.jsonl: values.get(m.key) for m in METRICS[phase] if m.jsonl
                       and (values.get(m.key) is not None or m.null_in_jsonl)})
        if self.run_id is not None:
            record["run_id"] = self.run_id
        with open(self.path, "a") as f:
            f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, directory: str):
        # imported here: a run without --tensorboard-dir needs no tensorboard package
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(directory)

    def write(self, phase: str, iteration: int, values: Dict[str, object]) -> None:
        for tag, value in scalars(phase, values).items():
            self.writer.add_scalar(tag, value, iteration)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, project: str, name: Optional[str], config: dict, save_dir: Optional[str]):
        """``save_dir``: where wandb writes its local files (None: wandb's default)."""
        import wandb  # optional: --wandb-project is refused before any work without it

        self.run = wandb.init(project=project, name=name, config=config, dir=save_dir)

    def write(self, phase: str, iteration: int, values: Dict[str, object]) -> None:
        self.run.log(scalars(phase, values), step=iteration)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Hands each record to every sink (none on ranks other than 0)."""

    def __init__(self, sinks: Sequence[object] = (), run_id: Optional[str] = None):
        self.sinks = list(sinks)
        self.run_id = run_id

    def log(self, phase: str, iteration: int, values: Dict[str, object]) -> None:
        for sink in self.sinks:
            sink.write(phase, iteration, values)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def new_run_id() -> str:
    """This run's id: start time, pid and a random part (one per run; rank 0 draws it and
    :func:`build_metrics_logger` hands it to every rank)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def build_metrics_logger(logging_cfg, train_iters: int, rank: int, run_config: dict,
                         wandb_dir: Optional[str] = None) -> MetricsLogger:
    """Rank 0's sinks from the logging section; other ranks write nothing. Collective under
    torch.distributed: every rank learns rank 0's run id (``MetricsLogger.run_id``).
    ``wandb_dir``: W&B's local directory (``ExperimentConfig.wandb_dir``)."""
    import torch.distributed as dist

    box = [new_run_id(), None, None]  # run id, error, note: rank 0's, for every rank
    if rank == 0 and logging_cfg.metrics_file:
        box[1], box[2] = existing_metrics_file(logging_cfg.metrics_file)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise InputError(box[1])
    if rank != 0:
        return MetricsLogger(run_id=box[0])
    if box[2]:
        print_rank_0(box[2])
    sinks: List[object] = [ConsoleSink(train_iters)]
    if logging_cfg.metrics_file:
        sinks.append(JsonlSink(logging_cfg.metrics_file, box[0]))
    if logging_cfg.tensorboard_dir:
        sinks.append(TensorBoardSink(logging_cfg.tensorboard_dir))
    if logging_cfg.wandb_project:
        sinks.append(WandbSink(logging_cfg.wandb_project, logging_cfg.wandb_exp_name,
                               json.loads(json.dumps(run_config, default=str)), wandb_dir))
    return MetricsLogger(sinks, run_id=box[0])


# ---- the values of a record ---------------------------------------------------------------
def jreg_summary(window: Sequence[Dict], num_layers: int, lam: float) -> Dict[str, object]:
    """LM loss, penalty, R, Psi and the top jump rates averaged over a window of steps;
    steps that ran nothing (no loss token in the global batch) are left out, and a window
    of only those has None for each (not measured: 0/0 is never a number)."""
    window = [w for w in window if not w.get("no_loss_tokens")]
    n = len(window)
    if not n:
        return dict.fromkeys(("lm_loss", "jreg_penalty", "R", "psi", "zeta_L", "zeta_L-1",
                              "zeta_L-2"))
    loss = sum(w["lm_loss"] for w in window) / n
    penalty = sum(w["penalty"] for w in window) / n
    psi = [sum(col) / n for col in zip(*(w["psi"] for w in window))]
    rates = jump_rates(psi)
    return {"lm_loss": loss, "jreg_penalty": penalty,
            "R": penalty / lam if lam else sum(w["R"] for w in window) / n, "psi": psi,
            "zeta_L": rates.get(num_layers, 0.0), "zeta_L-1": rates.get(num_layers - 1, 0.0),
            "zeta_L-2": rates.get(num_layers - 2, 0.0)}


def validation_summary(lm_loss: Optional[float], psi: List[float],
                       num_layers: int) -> Dict[str, object]:
    """lm_loss None: no validation batch had a loss token; nothing is reported as a number."""
    if lm_loss is None:
        return {"lm_loss": None, "ppl": None, "psi": None, "zeta_L": None}
    return {"lm_loss": lm_loss, "ppl": math.exp(min(lm_loss, 50)), "psi": psi,
            "zeta_L": jump_rates(psi).get(num_layers, 0.0)}


def run_summary(steps: int, seconds: float, skipped: int, no_loss_tokens: int,
                last: Optional[Dict]) -> str:
    """The end-of-run line: steps, time, the skipped steps by cause, the last step's values.
    ``skipped`` counts every skipped step, ``no_loss_tokens`` those with no loss token."""
    summary = f"done: {steps} steps in {seconds:.1f}s"
    causes = [(skipped - no_loss_tokens, "non-finite loss, penalty or gradients"),
              (no_loss_tokens, "no loss token in the global batch")]
    causes = [f"{count} skipped: {why}" for count, why in causes if count]
    if causes:
        summary += f" ({'; '.join(causes)})"
    if last is not None and last["lm_loss"] is not None:
        summary += f", last lm loss {last['lm_loss']:.6f}, last jreg penalty {last['penalty']:.6f}"
    return summary


def model_flops_per_token(model_cfg, vocab: int) -> float:
    """Forward+backward FLOPs per token of the dense Llama model (6N plus attention)."""
    h, layers, s = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.seq_length
    kv = model_cfg.query_groups * model_cfg.head_dim
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * model_cfg.ffn_size
    return 6.0 * (layers * per_layer + h * vocab) + 12.0 * layers * h * s
