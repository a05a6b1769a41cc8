"""What can be wrong with a checkpoint, as data: each fault holds its paths and facts, and
a command phrases it with its own flag names (:class:`Wording`). The library never takes a
flag name; ``str(fault)`` is the trainer's wording.

Two families, neither a kind of the other: :class:`CheckpointFault` (missing, torn,
damaged: pick another iteration) and :class:`UnsafeCheckpoint` (a file that would run
code or read outside its directory: rebuild the checkpoint with a trusted tool).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

from megatron_jreg.errors import CheckpointError, UserError


@dataclasses.dataclass(frozen=True)
class Wording:
    """The flags a command reads a checkpoint with, as its messages name them."""

    step: str = "--ckpt-step"  # picks an iteration
    root: str = "--load"  # names the directory
    skip_verify: Optional[str] = "--no-verify-checkpoint"  # loads past a checksum mismatch
    skip_rng: Optional[str] = "--no-load-rng"  # resumes without the saved random state


TRAINER = Wording()
TOOLS = Wording(step="--iteration", skip_verify=None, skip_rng=None)


def phrase(err: BaseException, wording: Wording) -> str:
    """``err``'s line in ``wording`` (a fault's own phrasing, else its text)."""
    if isinstance(err, (CheckpointFault, UnsafeCheckpoint)):
        return err.phrase(getattr(err, "wording", None) or wording)
    return str(err)


def _skip_rng(w: Wording) -> str:
    """The way on without the saved random state, where the command has that flag."""
    return f", or pass {w.skip_rng} to resume without the saved random state" if w.skip_rng else ""


class CheckpointFault(CheckpointError):
    """A checkpoint that cannot be used as asked. Subclasses set :meth:`phrase`."""

    def __init__(self, **facts):
        self.facts = facts
        for name, value in facts.items():
            setattr(self, name, value)
        super().__init__(self.phrase(TRAINER))

    def phrase(self, w: Wording) -> str:  # pragma: no cover - every subclass has one
        raise NotImplementedError

    def reword(self, w: Wording) -> "CheckpointFault":
        """This fault, worded in ``w`` from now on (:func:`phrase` keeps it): for a reader
        that knows which of the command's flags named the directory."""
        self.wording = w
        self.args = (self.phrase(w),)
        return self


class NoDirectory(CheckpointFault):
    """``root`` is missing or not a directory (``is_file``)."""

    def phrase(self, w):
        if self.is_file:
            return (f"{w.root} {self.root!r} is a file, not a checkpoint directory; pass the "
                    "directory the run saved into (its --save)")
        return f"{w.root} {self.root!r} does not exist: no such directory; check the path"


class IterationDirectoryGiven(CheckpointFault):
    """``root`` is one iteration's directory (``iteration``), not a save directory."""

    def phrase(self, w):
        return (f"{w.root} {self.root}: this is one iteration's directory; give its parent and "
                f"{w.step} {self.iteration}")


class NoCheckpoint(CheckpointFault):
    """``root`` holds no tracker and no whole iteration."""

    def phrase(self, w):
        return (f"{w.root} {self.root}: not a torch_dist checkpoint directory (no tracker and no "
                "whole iter_XXXXXXX directory), or no save there finished; give the --save "
                "directory of a training run")


def _escaped(text: str, cap: int = 20) -> str:
    """``text`` (a file's bytes decoded as UTF-8 with surrogateescape) as a message shows
    it: its first ``cap`` characters with everything but printable ASCII escaped
    (``'\\u0664'``, not a digit the terminal draws like 4), or as bytes where they are not
    UTF-8 (``b'\\x00\\xff'``)."""
    cut = text[:cap]
    try:
        cut.encode("utf-8")
        shown = ascii(cut)
    except UnicodeEncodeError:  # an undecodable byte, kept as a lone surrogate
        shown = repr(cut.encode("utf-8", "surrogateescape"))
    return shown + ("..." if len(text) > cap else "")


class TrackerUnreadable(CheckpointFault):
    """The tracker file holds ``text``, not an iteration number."""

    def phrase(self, w):
        return (f"{self.tracker} holds {_escaped(self.text)}, not an iteration number; delete "
                f"it to resume from the newest whole iteration, or pick one with {w.step}")


class IterationAbsent(CheckpointFault):
    """``iteration`` is not under ``root``; ``whole`` lists those that are."""

    def phrase(self, w):
        return (f"iteration {self.iteration} is not under {self.root!r}; whole iterations: "
                f"{self.whole or 'none'}")


class TornIteration(CheckpointFault):
    """``path`` was not completed (``reason``); ``earlier``: the newest whole one before."""

    def phrase(self, w):
        hint = (f"load an earlier one with {w.step} {self.earlier}" if self.earlier is not None
                else f"no earlier whole checkpoint exists; start without {w.root}")
        return f"checkpoint {self.path} is incomplete (torn save: {self.reason}); {hint}"


class DamagedFile(CheckpointFault):
    """A file of iteration ``path`` cannot be read (``detail``: which and why);
    ``checksum``: its manifest says it changed since it was saved; ``foreign``: it is not
    what dist-checkpointing writes (a pickle that does not read, or reads as something
    else), so it was written by another program or damaged."""

    def phrase(self, w):
        if self.checksum:
            skip = f" (or pass {w.skip_verify} to load it anyway)" if w.skip_verify else ""
            return (f"checkpoint {self.path} fails its checksum: {self.detail}; load an earlier "
                    f"one with {w.step}{skip}")
        skip = _skip_rng(w) if self.facts.get("rng") else ""
        if self.facts.get("foreign"):
            return (f"{self.detail}; it was not written by dist-checkpointing, or the directory "
                    f"is damaged: load an earlier one with {w.step}{skip}")
        return f"{self.detail}; the directory is damaged: load an earlier one with {w.step}{skip}"


class MissingRngFile(CheckpointFault):
    """An earlier version's per-rank random state file ``file`` is missing."""

    def phrase(self, w):
        skip = _skip_rng(w)
        return (f"{self.file} is missing (saved by {self.world} ranks, as many as now); the "
                f"directory is damaged: load an earlier one with {w.step}{skip}")


class NotAModel(CheckpointFault):
    """Iteration ``path`` does not describe a model this project builds (``detail``)."""

    def phrase(self, w):
        return f"{w.root} {self.root}: {self.detail}"


# Megatron-LM's conversion of a checkpoint to torch_dist: its training script loads the
# checkpoint and saves it under --ckpt-convert-save/<format> (megatron/training/training.py,
# core_v0.16.1), then exits
CONVERT = ("--ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save OUT")


class LegacyTorchFormat(CheckpointFault):
    """Iteration ``path`` (of save directory ``root``; ``step``: its number, None for
    ``release/``) is Megatron-LM's legacy ``--ckpt-format torch`` save: per-rank
    ``mp_rank_*/model_optim_rng.pt`` files (``shard``: the first), which dist-checkpointing
    cannot read."""

    def phrase(self, w):
        step = f" --ckpt-step {self.step}" if self.facts.get("step") is not None else ""
        return (f"{self.path} is Megatron-LM's legacy --ckpt-format torch checkpoint "
                f"({self.shard}), which megatron-core's dist-checkpointing cannot read; convert "
                f"it with Megatron-LM (its training script with --load {self.root}{step} "
                f"--use-checkpoint-args {CONVERT}) and pass {w.root} OUT/torch_dist")


class UnknownVersion(CheckpointFault):
    """``file``'s common state carries ``checkpoint_version`` ``version``, not one of
    ``known`` (Megatron-LM's versions of the layout this project reads)."""

    def phrase(self, w):
        v, shown = self.version, repr(self.version)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        said = ("NaN" if isinstance(v, float) and v != v
                else f"{shown} (a {type(v).__name__})" if not isinstance(v, (int, float))
                or isinstance(v, bool) else shown)
        known = ", ".join(str(k) for k in self.known)
        return (f"{self.file}: checkpoint_version is {said}; this project reads Megatron-LM's "
                f"torch_dist checkpoints of version {known} (what Megatron-LM core_v0.16.1 and "
                "this trainer write), so this one was written by another program or edited; "
                f"give a checkpoint saved by Megatron-LM or this project's trainer")


class ReleaseMissing(CheckpointFault):
    """The tracker says ``release`` (Megatron-LM's released weights) but ``path`` is not a
    whole checkpoint directory (``reason``)."""

    def phrase(self, w):
        return (f"{self.tracker} says 'release' (Megatron-LM's released weights, read from "
                f"{self.path}), but {self.reason}; give the directory holding release/, or "
                f"pick an iteration with {w.step}")


class UnsafeCheckpoint(UserError):
    """A checkpoint file that is not plain data in its directory: a pickle naming what it
    never holds (``imports``), a FIFO, device or link out of the directory, or a storage
    name that leaves it (``reason``). Never read; the fix is a trusted rebuild."""

    def __init__(self, file: str, reason: str):
        self.file, self.reason = file, reason
        super().__init__(self.phrase(TRAINER))

    def phrase(self, w: Wording) -> str:
        return (f"{self.file}: refused to load: {self.reason} (a checkpoint runs no code and "
                "reads nothing outside its directory here); rebuild the checkpoint with a tool "
                "you trust")


def whole_before(whole: List[int], iteration: int) -> Optional[int]:
    earlier = [i for i in whole if i < iteration]
    return earlier[-1] if earlier else None
