"""What a run starts from, each made once before the run is resolved: the checkpoint it loads
(:func:`choose`, :func:`read`, :func:`starting_point`) and its tokenizer (:func:`run_tokenizer`).

``--load`` when it holds a checkpoint, else ``--pretrained-checkpoint`` (weights only); the
choice and the read happen once per process, and everything after reads the frozen
:class:`StartingPoint`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from megatron_jreg.checkpoint import catalog, formats
from megatron_jreg.checkpoint.faults import CheckpointFault, Wording
from megatron_jreg.config.resolve import NULL_TOKENIZER, model_vocab
from megatron_jreg.data.tokenizers.build import build_tokenizer
from megatron_jreg.data.tokenizers.megatron_lm import (
    MEGATRON_LM_TOKENIZERS,
    build_megatron_tokenizer,
)
from megatron_jreg.errors import CheckpointError


class CheckpointChanged(CheckpointError):
    """The checkpoint read at parse time is no longer the one its directory gives."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """Which directory a run loads, before anything in it is read."""

    flag: str  # --load or --pretrained-checkpoint
    root: str
    step: Optional[int]
    weights_only: bool


@dataclasses.dataclass(frozen=True)
class StartingPoint:
    """A :class:`Choice` read: the iteration found, opened and described."""

    choice: Choice
    source: formats.Source

    @property
    def flag(self) -> str:
        return self.choice.flag

    @property
    def root(self) -> str:
        return self.choice.root

    @property
    def weights_only(self) -> bool:
        # Megatron-LM's release/ is weights only, also under --load (as Megatron-LM reads it)
        return self.choice.weights_only or self.source.ref.release


def loads_own_save(c) -> bool:
    """``--load`` is the run's ``--save``: the command line a restart repeats. Before its
    first save there is nothing to load, and the run starts from scratch (Megatron-LM's
    meaning); any other ``--load`` must hold a checkpoint."""
    return bool(c.load and c.save and os.path.realpath(c.load) == os.path.realpath(c.save))


# --load holding a checkpoint is a resumed run (also one begun from --pretrained-checkpoint: a
# requeued fine-tuning job continues exactly); --finetune without --pretrained-checkpoint loads
# --load's weights only (Megatron-LM's meaning). The choice and the read (catalog, trusted open,
# descriptor: checkpoint.formats.read) happen at parse time under --use-checkpoint-args, else
# when the plan is made.
def choose(c, load_catalog: Optional[catalog.Catalog] = None) -> Optional[Choice]:
    """The directory the checkpoint section ``c`` loads, or None (a run from scratch: also
    one whose ``--load`` is its own ``--save`` holding no checkpoint yet); ``load_catalog``:
    ``--load``'s scan when the caller has one."""
    if c.load and (c.pretrained_checkpoint or loads_own_save(c)):
        found = (load_catalog or catalog.scan(c.load)).holds_checkpoint
    else:
        found = bool(c.load)
    if found:
        return Choice("--load", c.load, c.ckpt_step,
                      bool(c.finetune and not c.pretrained_checkpoint))
    if c.pretrained_checkpoint:
        return Choice("--pretrained-checkpoint", c.pretrained_checkpoint, None, True)
    return None


def read(choice: Choice, verify: bool) -> StartingPoint:
    """``choice`` read through the checkpoint pipeline; a fault is phrased with the
    trainer's flag for that directory."""
    try:
        return StartingPoint(choice, formats.read(choice.root, choice.step, verify=verify))
    except CheckpointFault as fault:
        fault.reword(Wording(root=choice.flag))  # the same fault, phrased with the flag
        raise


def starting_point(c, already: Optional[StartingPoint] = None) -> Optional[StartingPoint]:
    """The run's starting point: ``already`` (read at parse time) when it is the one ``c``
    chooses and the directory still gives that iteration there, else read now. Called
    holding --save's lock, so a change since the parse is another run's save or a killed
    save the lock put back in place; the first is refused (the settings were read from the
    older iteration), the second read where it lies now."""
    choice = choose(c)
    if choice is None:
        return None
    verify = not c.no_verify_checkpoint
    if already is None or already.choice != choice:
        return read(choice, verify)
    read_then = already.source.ref
    try:
        now = catalog.scan(choice.root).resolve(choice.step)
    except CheckpointFault as fault:
        fault.reword(Wording(root=choice.flag))  # the same fault, phrased with the flag
        raise
    if now.iteration != read_then.iteration:
        raise CheckpointChanged(
            f"{choice.flag} {choice.root} changed while this run started: --use-checkpoint-args "
            f"read iteration {read_then.iteration}, and it now holds iteration {now.iteration} "
            "(another run saved it meanwhile); start this run again to continue from there")
    if os.path.realpath(now.path) != os.path.realpath(read_then.path):
        return read(choice, verify)  # a killed save's whole copy, renamed into place
    return already


def run_tokenizer(data, model):
    """The run's tokenizer, from the data and model settings as given (before the run is
    resolved), and the model settings as the checks read them (a new object when they
    change: NullTokenizer's vocabulary counts its end-of-document id)."""
    if data.tokenizer_type not in MEGATRON_LM_TOKENIZERS:
        return build_tokenizer(data.tokenizer_type, data.tokenizer_model,
                               legacy=data.legacy_tokenizer), model
    tokenizer = build_megatron_tokenizer(data.tokenizer_type, data.tokenizer_model,
                                         model.vocab_size, data.vocab_file, data.merge_file,
                                         legacy=data.legacy_tokenizer)
    if data.tokenizer_type == NULL_TOKENIZER:
        # --vocab-size counts the ids before the end-of-document id (Megatron-LM's rule);
        # the settings say so before they are checked and resolved
        vocab = model_vocab(model.vocab_size, data.tokenizer_type, tokenizer.vocab_size)
        model = dataclasses.replace(model, vocab_size=vocab)
    return tokenizer, model
