"""One writer per checkpoint directory.

A run takes ``SAVE/jreg_writer.lock`` before its first save and removes it at exit; rank 0
holds it for the whole job. A second run with the same ``--save`` is refused with the
holder's name. A gone holder's lock is taken over with one line saying who held it and why
(writer_lock.py: a dead pid on this host, the same Slurm job requeued, or a lapsed lease on
another host), so a requeue on another node resumes; a live holder's never is.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from megatron_jreg.atomic_write import MADE_DIRECTORIES
from megatron_jreg.writer_lock import WriterLock, describe_holder

LOCK = "jreg_writer.lock"


class SaveDirectoryBusy(ValueError):
    """Another live run writes to the same --save directory."""


class SaveLock(WriterLock):
    """``writer_lock.WriterLock`` on ``SAVE/jreg_writer.lock``, with the trainer's words."""

    def __init__(self, root: str):
        super().__init__(os.path.join(root, LOCK))
        self.root = root

    def busy(self, holder: Dict, why: str) -> Exception:
        who = describe_holder(holder).replace("process", "run")
        return SaveDirectoryBusy(
            f"--save {self.root} is in use by {who}, {why}: one run writes a checkpoint directory "
            f"at a time; wait for it to end or pick another --save (if that run is gone, delete "
            f"{self.path})")

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a warning line when a gone holder's lock was taken over.
        Raises SaveDirectoryBusy naming the holder when a live run holds it."""
        # a directory this run made (here, or in the start-up checks of its outputs) is
        # removed again if it still holds nothing at the end (release): a run that stops
        # before its first save leaves no empty --save behind
        self.made_root = (not os.path.isdir(self.root)
                          or os.path.abspath(self.root) in MADE_DIRECTORIES)
        os.makedirs(self.root, exist_ok=True)
        warning = super().acquire()
        return f"{warning} (in {self.root})" if warning else None

    def release(self) -> None:
        super().release()
        if getattr(self, "made_root", False):
            try:
                os.rmdir(self.root)  # only when empty: a save, or anything else, keeps it
            except OSError:
                pass

    def lost(self) -> Optional[str]:
        """None while this run holds the lock, else why it must not write: another run took
        it over (this one's lease lapsed) or the file is gone."""
        if self.still_held():
            return None
        return (f"--save {self.root}: this run no longer holds {self.path} (another run took it "
                f"over after this run's heartbeat lapsed, or the file was removed); stopping "
                "without saving so that two runs never write one directory")
