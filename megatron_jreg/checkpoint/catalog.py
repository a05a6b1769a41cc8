"""The one catalog of a save directory: which iterations are whole, which to read, what a
killed save left. Every reader and the writer ask it; nothing else decides wholeness.

An iteration is whole when it holds our completion marker, or, holding none of our files,
dist-checkpointing's last files (Megatron-LM). The tracker names the latest save; without one
the newest whole iteration is read. Megatron-LM's legacy ``--ckpt-format torch`` iterations
are named (with their conversion), and its ``release/`` directory is read as iteration 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Dict, List, Optional, Tuple

from megatron_jreg.checkpoint import faults
from megatron_jreg.checkpoint.files import open_regular
from megatron_jreg.checkpoint.interrupted import COMPLETE, MARKED_SUFFIXES, left_whole_of

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "jreg_manifest.json"
RUN_CONFIG = "run_config.yaml"
TOKENIZER_DIR = "tokenizer"  # a Hugging Face tokenizer's files, carried with the weights
RNG_FILES_DIR = "rng"  # earlier versions' per-rank random state files
OWN_FILES = (COMPLETE, MANIFEST, RUN_CONFIG, RNG_FILES_DIR)  # any of them: a save of ours
# what dist-checkpointing writes of every save, metadata.json last
DIST_CKPT_FILES = (".metadata", "common.pt", "metadata.json")
TRACKER_BYTES = 64
RELEASE = "release"  # Megatron-LM's tracker text and directory of released weights
# Megatron-LM's legacy torch format: a directory per model-parallel rank (tensor rank, then
# pipeline and expert ranks when there are several), each holding this file
LEGACY_RANK_DIR = re.compile(r"mp_rank_\d{2}(_\d{3}){0,2}")
LEGACY_FILE = "model_optim_rng.pt"


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _iteration_of(name: str) -> Optional[int]:
    return int(name[5:]) if name.startswith("iter_") and name[5:].isdigit() else None


def torn_reason(names: set) -> Optional[str]:
    """None when an iteration directory holding file ``names`` is whole, else what is
    missing: our completion marker (a save of ours), or dist-checkpointing's last files."""
    if COMPLETE in names:
        return None
    if any(n in names for n in OWN_FILES):
        return f"no {COMPLETE}"
    absent = [n for n in DIST_CKPT_FILES if n not in names]
    return f"no {', '.join(absent)}" if absent else None


def legacy_shard(path: str, names: set) -> Optional[str]:
    """The first per-rank file of Megatron-LM's legacy torch format in iteration directory
    ``path`` (listing ``names``), as ``mp_rank_00/model_optim_rng.pt``; None when it holds
    dist-checkpointing's index or no per-rank directory."""
    if ".metadata" in names:
        return None
    ranks = sorted(n for n in names if LEGACY_RANK_DIR.fullmatch(n)
                   and os.path.isdir(os.path.join(path, n)))
    for rank in ranks:
        if LEGACY_FILE in _listing(os.path.join(path, rank)):
            return f"{rank}/{LEGACY_FILE}"
    return f"{ranks[0]}/" if ranks else None


def _listing(path: str) -> set:
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


@dataclasses.dataclass(frozen=True)
class Ref:
    """One whole iteration to read: its number and directory (iter_N, or the whole copy a
    save killed in its renames left), and the note to print when it is such a copy."""

    root: str
    iteration: int
    path: str
    note: Optional[str] = None
    release: bool = False  # Megatron-LM's release/: weights only, read as iteration 0


@dataclasses.dataclass(frozen=True)
class Catalog:
    """A save directory scanned once (:func:`scan`)."""

    root: str
    exists: bool
    is_file: bool
    whole_dirs: Tuple[int, ...]  # iterations whose iter_N directory is whole
    whole: Tuple[int, ...]  # iterations readable (iter_N whole, or a left whole copy), ascending
    torn: Dict[int, str]  # iter_N directories that are not whole: what they miss
    left_whole: Dict[int, str]  # iteration -> a whole copy a killed save left (the writer renames)
    leftovers: Tuple[str, ...]  # partials, replaced copies and tracker temp files to clear
    tracker: Optional[str]  # the tracker's text (stripped), None without one
    held: Tuple[str, ...]  # the tracker and every iter_N name (whole or not), sorted
    own_iteration: Optional[int]  # root is itself a whole iteration directory (its number)
    legacy: Dict[int, str] = dataclasses.field(default_factory=dict)  # iter_N in Megatron-LM's
    # legacy torch format: its first per-rank file (legacy_shard)
    release: Optional[Tuple[str, Optional[str]]] = None  # release/: ("whole", None), ("torn",
    # what it misses) or ("legacy", its first per-rank file); None without one
    own_legacy: Optional[str] = None  # root is itself a legacy iteration: its first rank file

    @property
    def holds_checkpoint(self) -> bool:
        """A run that names this directory resumes from it (a tracker, a whole iteration,
        Megatron-LM's released weights, or a legacy iteration, which the read names)."""
        return (self.tracker is not None or bool(self.whole) or bool(self.legacy)
                or self.release is not None or self.own_legacy is not None)

    def newest(self) -> Optional[int]:
        return self.whole[-1] if self.whole else None

    def read_aside(self, iteration: int) -> Optional[str]:
        """The name readers read ``iteration`` under when ``iter_N`` is not whole: the
        whole copy a killed save left; None to read ``iter_N``."""
        return None if iteration in self.whole_dirs else self.left_whole.get(iteration)

    def path_of(self, iteration: int) -> str:
        return os.path.join(self.root, self.read_aside(iteration) or iteration_name(iteration))

    def resolve(self, iteration: Optional[int] = None) -> Ref:
        """The iteration to read: ``iteration``, else the tracker's, else the newest whole
        one; raises a fault (faults.py) when it is not there or not whole."""
        if not self.exists:
            raise faults.NoDirectory(root=self.root, is_file=self.is_file)
        if iteration is None:
            if self.tracker is None:
                if self.own_iteration is not None:
                    raise faults.IterationDirectoryGiven(
                        root=self.root, iteration=self.own_iteration)
                if self.own_legacy is not None:
                    base = os.path.basename(os.path.normpath(self.root))
                    raise faults.LegacyTorchFormat(path=self.root, shard=self.own_legacy,
                                                   root=os.path.dirname(os.path.normpath(self.root)),
                                                   step=_iteration_of(base))
                if not self.whole:
                    if self.legacy:
                        return self.resolve(max(self.legacy))
                    if self.release is not None:
                        return self._release(f"{self.root}: no {TRACKER}; reading")
                    raise faults.NoCheckpoint(root=self.root)
                return self._ref(self.whole[-1], f"{self.root}: no {TRACKER}; using the newest "
                                                 f"whole iteration {self.whole[-1]}")
            if self.tracker == RELEASE:
                return self._release(f"{self.root}: {TRACKER} says {RELEASE}; reading")
            if not (self.tracker.isascii() and self.tracker.isdigit()):  # ASCII, as saves write
                raise faults.TrackerUnreadable(tracker=os.path.join(self.root, TRACKER),
                                               text=self.tracker)
            iteration = int(self.tracker)
        if iteration in self.legacy:
            raise faults.LegacyTorchFormat(path=os.path.join(self.root, iteration_name(iteration)),
                                           shard=self.legacy[iteration], root=self.root,
                                           step=iteration)
        if iteration in self.torn and self.read_aside(iteration) is None:
            raise faults.TornIteration(path=os.path.join(self.root, iteration_name(iteration)),
                                       reason=self.torn[iteration],
                                       earlier=faults.whole_before(list(self.whole), iteration))
        if iteration not in self.whole:
            raise faults.IterationAbsent(root=self.root, iteration=iteration,
                                         whole=list(self.whole))
        return self._ref(iteration)

    def _ref(self, iteration: int, note: Optional[str] = None) -> Ref:
        left = self.read_aside(iteration)
        if left is not None:
            note = (f"{self.root}: iteration {iteration} is read from {left}, the whole copy a "
                    f"save killed in its renames left (the next training run with --save "
                    f"{self.root} renames it to {iteration_name(iteration)})")
        return Ref(self.root, iteration, self.path_of(iteration), note)

    def _release(self, lead: str) -> Ref:
        """Megatron-LM's released weights (``release/``), as Megatron-LM reads them: iteration
        0, weights only; ``lead``: how the note starts."""
        path = os.path.join(self.root, RELEASE)
        kind, detail = self.release or ("absent", None)
        if kind == "legacy":
            raise faults.LegacyTorchFormat(path=path, shard=detail, root=self.root, step=None)
        if kind != "whole":
            raise faults.ReleaseMissing(tracker=os.path.join(self.root, TRACKER), path=path,
                                        reason=(f"it is incomplete ({detail})" if kind == "torn"
                                                else "there is no such directory"))
        return Ref(self.root, 0, path, f"{lead} {path}, Megatron-LM's released weights, as "
                                       "iteration 0 (weights only, as Megatron-LM reads them)",
                   release=True)

    def later_than(self, iteration: int) -> List[int]:
        return [i for i in self.whole if i > iteration]


def read_tracker(path: str) -> str:
    """The tracker file's first bytes as text (UTF-8, a byte that is not UTF-8 kept as a lone
    surrogate), read only from a regular file (a FIFO or device there is read as garbage,
    never waited on)."""
    try:
        with open_regular(path, os.path.dirname(path)) as f:
            raw = f.read(TRACKER_BYTES)
    except faults.UnsafeCheckpoint:
        return "(not a regular file)"
    except faults.DamagedFile:  # gone since the listing
        return ""
    # undecodable bytes kept (as lone surrogates) for the fault to show as bytes
    return raw.decode("utf-8", errors="surrogateescape").strip()


def scan(root: str) -> Catalog:
    """``root`` listed once: its iterations, their wholeness, leftovers and tracker."""
    exists, is_file = os.path.isdir(root), os.path.exists(root) and not os.path.isdir(root)
    names = _listing(root) if exists else set()
    whole, torn, legacy, leftovers, held = [], {}, {}, [], []
    for name in names:
        iteration = _iteration_of(name)
        path = os.path.join(root, name)
        if iteration is not None and os.path.isdir(path):
            held.append(name)
            listed = _listing(path)
            shard = legacy_shard(path, listed)
            reason = torn_reason(listed)
            if shard is not None:
                legacy[iteration] = shard
            elif reason is None:
                whole.append(iteration)
            else:
                torn[iteration] = reason
        elif (name.startswith("iter_") and name.partition(".")[2].startswith(MARKED_SUFFIXES)) \
                or name.startswith(TRACKER + ".tmp"):
            leftovers.append(name)
    left = left_whole_of(root, names, set(whole) | set(torn) | set(legacy))
    release = None
    if RELEASE in names and os.path.isdir(os.path.join(root, RELEASE)):
        held.append(RELEASE)
        listed = _listing(os.path.join(root, RELEASE))
        shard, reason = legacy_shard(os.path.join(root, RELEASE), listed), torn_reason(listed)
        release = (("legacy", shard) if shard is not None else ("whole", None) if reason is None
                   else ("torn", reason))
    tracker = read_tracker(os.path.join(root, TRACKER)) if TRACKER in names else None
    if tracker is not None:
        held.append(TRACKER)
    base = os.path.basename(os.path.normpath(root))
    own = _iteration_of(base)
    own_legacy = (legacy_shard(root, names) if exists and (own is not None or base == RELEASE)
                  else None)
    own = own if own is not None and exists and torn_reason(names) is None else None
    return Catalog(root=root, exists=exists, is_file=is_file, whole_dirs=tuple(sorted(whole)),
                   whole=tuple(sorted(set(whole) | set(left))), torn=torn, left_whole=left,
                   leftovers=tuple(sorted(leftovers)), tracker=tracker, held=tuple(sorted(held)),
                   own_iteration=own, legacy=legacy, release=release, own_legacy=own_legacy)

