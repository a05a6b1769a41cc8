"""SIGTERM/SIGINT (and --exit-signal) as a request to save and exit at the end of the
current step (one process), or of the next step all ranks check (several)."""

from __future__ import annotations

import signal
from typing import Iterable, Optional

import torch
import torch.distributed as dist

# Iterations between the ranks' agreements on a stop (a signal, --exit-duration-in-mins):
# with several processes a stop is honoured within this many steps, or at the next save
# if that comes first. Slurm's warning (examples/slurm) must outlast them and a save.
CHECK_INTERVAL = 10


class SignalFlag:
    """Records SIGTERM/SIGINT and the ``extra`` signals (Megatron-LM's --exit-signal, e.g.
    SIGUSR1 from Slurm's --signal); the loop saves and exits at the first step where
    :meth:`stop_reason` sees it."""

    def __init__(self, enabled: bool, extra: Iterable[int] = ()):
        self.received: Optional[int] = None
        if enabled:
            for sig in {signal.SIGTERM, signal.SIGINT, *extra}:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def stop_reason(self, device, iteration: Optional[int] = None, time_is_up: bool = False,
                    at_save: bool = False) -> Optional[str]:
        """Why to stop now, the same on every rank: "signal" when any rank received one,
        else "time" when any rank's time limit passed, else None. A signal sent to one rank
        only (Slurm may signal one task) is named as such everywhere.

        One process decides from its own flags at every step, with no collective. Several
        all-reduce the flags (a collective, and a wait for the device's queue) only where
        all of them ask alike: every :data:`CHECK_INTERVAL` iterations, at a step that was
        just saved (``at_save``) and when ``iteration`` is None; elsewhere None."""
        local = 2 if self.received else 1 if time_is_up else 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            if not (at_save or iteration is None or iteration % CHECK_INTERVAL == 0):
                return None
            code = torch.tensor([float(local)], device=device)
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
            local = int(code.item())
        return {2: "signal", 1: "time"}.get(local)
