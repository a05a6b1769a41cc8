"""One writer per checkpoint directory.

A run takes ``SAVE/jreg_writer.lock`` (host, pid, start time, run id) before its first save
and removes it at exit. A second run with the same ``--save`` is refused with the holder's
name; a lock whose process is gone (same host, dead pid) is taken over with a warning.
Creation is ``O_CREAT | O_EXCL``, so of two runs starting together exactly one wins.
"""

from __future__ import annotations

import os
from typing import Dict, Optional

from megatron_jreg.atomic_write import WriterLock, describe_holder

LOCK = "jreg_writer.lock"


class SaveDirectoryBusy(ValueError):
    """Another live run writes to the same --save directory."""


class SaveLock(WriterLock):
    """``atomic_write.WriterLock`` on ``SAVE/jreg_writer.lock``, with the trainer's words."""

    def __init__(self, root: str):
        super().__init__(os.path.join(root, LOCK))
        self.root = root

    def busy(self, holder: Dict) -> Exception:
        who = describe_holder(holder).replace("process", "run")
        return SaveDirectoryBusy(
            f"--save {self.root} is in use by {who}: one run writes a checkpoint directory at a "
            f"time; wait for it to end or pick another --save (if that run is gone, delete {self.path})")

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a warning line when a stale lock was taken over. Raises
        SaveDirectoryBusy naming the holder when a live run holds it."""
        os.makedirs(self.root, exist_ok=True)
        warning = super().acquire()
        return f"{warning} in {self.root}" if warning else None
