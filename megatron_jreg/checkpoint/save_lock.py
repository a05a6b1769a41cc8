"""One writer per checkpoint directory.

A run takes ``SAVE/jreg_writer.lock`` (host, pid, start time, run id) before its first save
and removes it at exit. A second run with the same ``--save`` is refused with the holder's
name; a lock whose process is gone (same host, dead pid) is taken over with a warning.
Creation is ``O_CREAT | O_EXCL``, so of two runs starting together exactly one wins.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Dict, Optional

LOCK = "jreg_writer.lock"


class SaveDirectoryBusy(ValueError):
    """Another live run writes to the same --save directory."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read(path: str) -> Optional[Dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or garbage: treated as a lock of unknown holder


class SaveLock:
    def __init__(self, root: str):
        self.root = root
        self.path = os.path.join(root, LOCK)
        self.run_id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.held = False

    def _create(self) -> bool:
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "start_time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "run_id": self.run_id}
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        self.held = True
        return True

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a warning line when a stale lock was taken over. Raises
        SaveDirectoryBusy naming the holder when a live run holds it."""
        os.makedirs(self.root, exist_ok=True)
        if self._create():
            return None
        holder = _read(self.path)
        if holder is None and self._create():  # released between the two calls
            return None
        holder = holder or {}
        host, pid = holder.get("host"), holder.get("pid")
        same_host = host == socket.gethostname()
        if same_host and isinstance(pid, int) and not _pid_alive(pid):
            # move the stale lock aside under a unique name: of two runs taking it over at
            # once, only one rename succeeds and only one O_EXCL create after it
            aside = f"{self.path}.stale-{self.run_id}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                pass
            else:
                os.remove(aside)
            if self._create():
                return (f"warning: took over the lock of a finished run (pid {pid} on {host}, "
                        f"started {holder.get('start_time')}) in {self.root}")
            holder = _read(self.path) or {}
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started "
               f"{holder.get('start_time')}" if holder else "an unknown run (unreadable lock)")
        raise SaveDirectoryBusy(
            f"--save {self.root} is in use by {who}: one run writes a checkpoint directory at a "
            f"time; wait for it to end or pick another --save (if that run is gone, delete {self.path})")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        holder = _read(self.path)
        if holder and holder.get("run_id") == self.run_id:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
