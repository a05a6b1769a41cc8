"""Where hidden states come from: the source interface and one model to evaluate.

A source (:class:`HiddenStateSource`) is one loaded model that tokenizes text and pushes the
per-layer pairs (h_{l-1}, h_l) of a padded batch into a :class:`JumpAccumulator`; a
:class:`SourceEntry` opens one per model to evaluate (one per iteration for a trajectory).
``hf_source.hf_entries`` (``--hf-model``) and ``checkpoint_source.checkpoint_entries``
(``--load``) make the entries, and ``eval_jump`` calls them; this module imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

import torch

from megatron_jreg.analysis.batching import MeasureWorld, one_process
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator


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
    """Where the opened source runs (asked after ``open``): one process unless the source
    spreads the model over a torchrun world."""
