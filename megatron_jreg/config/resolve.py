"""The one resolution of a run: every value derived from the settings, the inputs and the
machine, computed once before any work into the run that trains and that ``run_config.yaml``
records (the trainer calls :func:`resolve`).

:func:`resolve` reads no file: the caller passes the facts in (:class:`RunFacts`: the built
tokenizer, the machine, the checkpoint the run starts from) and gets new sections back, the
settings it was given unchanged, so the same settings and facts always give equal runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, TypeVar

from megatron_jreg.errors import ConfigError

# Megatron-LM's tokenizer whose --vocab-size leaves out the end-of-document id
NULL_TOKENIZER = "NullTokenizer"

Run = TypeVar("Run")


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What the inputs and the machine say, each gathered (with its own checks) before
    the run is resolved."""

    tokenizer_vocab_size: int
    """The built tokenizer's vocabulary size."""
    tokenizer_identity: Optional[str] = None
    """The built tokenizer's identity (``data.tokenizers.tokenizer_identity``)."""
    transformer_impl: str = "local"
    """What ``--transformer-impl`` resolves to here: local or transformer_engine."""
    checkpoint: Optional[str] = None
    """The checkpoint the run loads, as its flag and directory (``--load DIR``), or None."""
    saved_embedding_rows: Optional[int] = None
    """The embedding rows that checkpoint holds."""
    saved_schedule: Optional[Mapping[str, Any]] = None
    """The schedule state that checkpoint holds, when the run keeps it (a resume under
    ``--use-checkpoint-opt-param-scheduler``)."""


def model_vocab(vocab_size: Optional[int], tokenizer_type: str, tokenizer_vocab_size: int) -> int:
    """The model's vocabulary: ``--vocab-size`` when given, else the tokenizer's; always
    the tokenizer's for the NullTokenizer, whose ``--vocab-size`` counts one id fewer."""
    if vocab_size is None or tokenizer_type == NULL_TOKENIZER:
        return tokenizer_vocab_size
    return vocab_size


def padded_rows(model, tensor_parallel: int, facts: RunFacts) -> int:
    """Embedding rows: a resumed checkpoint's own (so a checkpoint padded otherwise, e.g.
    by an earlier version that multiplied by TP, still loads), else the vocabulary padded
    to --make-vocab-size-divisible-by."""
    rows = model.padded_to_multiple()
    saved = facts.saved_embedding_rows
    if saved is None:
        return rows
    if saved < model.vocab_size:
        raise ConfigError(f"{facts.checkpoint}: the saved embedding has {saved} rows, "
                          f"fewer than the tokenizer's {model.vocab_size}; wrong tokenizer or "
                          "checkpoint")
    if saved % tensor_parallel:
        raise ConfigError(f"{facts.checkpoint}: the saved embedding has {saved} rows, not "
                          f"divisible by --tensor-model-parallel-size {tensor_parallel}; pick a "
                          "TP that divides it")
    return saved


def kept_schedule(schedule: Mapping[str, Any], global_batch: int) -> dict:
    """The optimizer settings of a schedule a resumed run keeps (a scheduler's values,
    lengths in samples): each length in steps when whole, else in samples."""
    def split(samples) -> tuple:  # (steps, None) or (None, samples)
        whole = float(samples) % global_batch == 0
        return (int(samples) // global_batch, None) if whole else (None, int(samples))

    out = {"lr": schedule["max_lr"], "min_lr": schedule["min_lr"],
           "lr_decay_style": schedule["lr_decay_style"], "weight_decay": schedule["start_wd"]}
    iters, samples = split(schedule["lr_warmup_steps"])
    out.update(lr_warmup_iters=iters or 0, lr_warmup_samples=samples or 0,
               lr_warmup_fraction=None)
    out["lr_decay_iters"], out["lr_decay_samples"] = split(schedule["lr_decay_steps"])
    if schedule.get("wsd_decay_steps"):
        out["lr_wsd_decay_iters"], out["lr_wsd_decay_samples"] = split(schedule["wsd_decay_steps"])
        out["lr_wsd_decay_style"] = schedule["lr_wsd_decay_style"]
    return out


def effective_parallel(parallel):
    """The parallel section as it runs: sequence parallelism off at tensor-parallel size 1
    (Megatron-LM's rule); the same object when nothing changes."""
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        return dataclasses.replace(parallel, sequence_parallel=False)
    return parallel


def resolve(raw: Run, facts: RunFacts) -> Run:
    """The run ``raw`` (an experiment: sections ``model``, ``parallel``, ``optim``,
    ``training``, ``data``, ...) stands for, given ``facts``: a new object of the same type
    with every derived value set; ``raw`` is left as it was."""
    model, parallel, data = raw.model, raw.parallel, raw.data
    tp = parallel.tensor_model_parallel_size
    model = dataclasses.replace(
        model, vocab_size=model_vocab(model.vocab_size, data.tokenizer_type,
                                      facts.tokenizer_vocab_size),
        transformer_impl=facts.transformer_impl, padded_vocab=None)
    model = dataclasses.replace(model, padded_vocab=padded_rows(model, tp, facts))
    parallel = effective_parallel(parallel)
    optim = raw.optim
    if facts.saved_schedule is not None:
        global_batch = raw.training.global_batch_size
        optim = dataclasses.replace(optim, **kept_schedule(facts.saved_schedule, global_batch))
    data = dataclasses.replace(data, tokenizer_identity=facts.tokenizer_identity)
    return dataclasses.replace(raw, model=model, parallel=parallel, optim=optim, data=data)
