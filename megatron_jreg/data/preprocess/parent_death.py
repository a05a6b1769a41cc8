"""Child processes that die with their parent, even when the parent is SIGKILLed.

A SIGKILLed (or OOM-killed) preprocessing parent runs no cleanup, so it cannot stop its
children: pool workers would wait forever for work (their siblings keep the task pipe open)
and partition processes would run to the end of their input, writing into a temp directory
nobody removes. Each child calls :func:`die_with_parent` first thing.

Nothing here imports megatron-core or torch: pool workers import it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_SECONDS = 0.5


def _set_parent_death_signal() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies; False where unsupported.

    The signal fires when the parent *thread* that forked this process exits; preprocessing
    starts its children from the main thread, which lives as long as the parent does.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int) -> None:
    # An orphan is re-parented (to init or a subreaper), so its parent id changes.
    while os.getppid() == parent_pid:
        time.sleep(_POLL_SECONDS)
    os._exit(1)  # at once: the parent is gone, nobody wants what this process would write


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (the process that started it) ends.

    prctl(PR_SET_PDEATHSIG) on Linux; elsewhere a daemon thread that polls the parent id.
    """
    if not _set_parent_death_signal():
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True,
                         name="die-with-parent").start()
    if os.getppid() != parent_pid:  # the parent died before the above took effect
        os._exit(1)
