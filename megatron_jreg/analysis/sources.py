"""Where hidden states come from: the source interface and the source kinds' shape.

A *source* is one loaded model that can tokenize text and push the per-layer pairs
(h_{l-1}, h_l) of a padded batch into a :class:`JumpAccumulator`. A *source kind* is a
family of sources with its own command-line flags (``--hf-model`` for Hugging Face
directories, ``--load`` for our trainer's checkpoints); ``tools/eval_jump.py`` knows only
the registry of kinds (:mod:`source_kinds`). This module imports no kind.

Adding a kind:

1. Write a class satisfying :class:`HiddenStateSource` (see ``hf_source.HFCausalLMSource``
   and ``checkpoint_source.CheckpointSource``).
2. Write a :class:`SourceKind` with the dataclass of its flags (``flags``; the command
   ``eval_jump`` adds them) and a ``build`` that checks the parsed values and returns one
   :class:`SourceEntry` per model to evaluate (one per iteration for a trajectory; set
   ``iteration`` so eval_jump prints the trajectory table and plot).
3. Append it to :func:`source_kinds.builtin_source_kinds`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

import torch

from megatron_jreg.analysis.batching import MeasureWorld, one_process
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.errors import InputError


@runtime_checkable
class HiddenStateSource(Protocol):
    """One loaded model, ready to measure."""

    name: str
    """The default label of the model in reports."""
    num_layers: int
    """L."""
    include_final_norm: bool
    """Whether ``accumulate`` applies the final norm to h_L."""
    vocab_size: int
    """Token ids fed to ``accumulate`` are < vocab_size (checked for pre-tokenized data)."""
    pad_id: int
    """The id put in padding positions (never counted; any valid id works)."""

    def tokenize(self, text: str) -> List[int]:
        """Token ids of one document, special tokens as the model's tokenizer adds them."""

    def accumulate(self, input_ids: torch.Tensor, mask: torch.Tensor, acc: JumpAccumulator) -> None:
        """Run one batch and call ``acc.add(l, h_{l-1}, h_l, token_mask)`` for l = 1..L.

        input_ids: [b, s] int64, right-padded; mask: [b, s] bool, True on real tokens.
        The source passes the mask in its own layout (Megatron's [s, b, h] states take
        ``mask.t()``), or reduces the sums itself and calls ``acc.add_sums``. A source
        spread over ranks adds this rank's share; :class:`MeasureWorld` sums the ranks.
        """


@dataclass(kw_only=True)
class SourceEntry:
    """One model to evaluate, opened lazily so a trajectory holds one model at a time."""

    label: str
    """The model name written in the report."""
    open: Callable[[], HiddenStateSource]
    """Loads the model (may raise InputError)."""
    iteration: Optional[int] = None
    """The training iteration, for checkpoints of a run (trajectory output)."""
    describe: str = ""
    """Where the model came from (a path), written to the report's ``source`` key."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Further keys for the report (e.g. the iteration of one of several runs' checkpoints)."""
    world: Callable[[], MeasureWorld] = one_process
    """Where the opened source runs (asked after ``open``): one process unless the kind
    spreads the model over a torchrun world."""


@dataclass(kw_only=True)
class SourceKind:
    """A family of sources and its command-line flags.

    A kind's settings reach it as the parsed values: one attribute per flag (its field
    name), whatever kind they belong to."""

    name: str
    """Short name, used in error messages."""
    flag: str
    """The flag that selects this kind (e.g. ``--hf-model``)."""
    selected: Callable[[Any], bool]
    """True when the parsed values ask for this kind."""
    build: Callable[[Any], List[SourceEntry]]
    """Validates the values (raising InputError) and lists the models to evaluate."""
    flags: Optional[type] = None
    """The dataclass whose fields are the kind's flags (the command makes them)."""
    add_arguments: Optional[Callable[[Any], None]] = None
    """Adds the kind's flags to an argument group itself, for a kind without ``flags``."""


def build_sources(args: Any, kinds: List[SourceKind]) -> List[SourceEntry]:
    """The models the parsed values ask for: none, or those of exactly one kind."""
    chosen = [kind for kind in kinds if kind.selected(args)]
    if len(chosen) > 1:
        flags = " and ".join(kind.flag for kind in chosen)
        raise InputError(f"{flags} were both given; measure one kind of model per run")
    if not chosen:
        return []
    entries = chosen[0].build(args)
    labels = getattr(args, "label", None) or []
    if labels:
        if len(labels) != len(entries):
            raise InputError(
                f"--label was given {len(labels)} times for {len(entries)} models; "
                "give one --label per model, in order"
            )
        for entry, label in zip(entries, labels):
            entry.label = label
    return entries
