"""SIGTERM/SIGINT (and --exit-signal) as a request to save and exit at the end of the
current step."""

from __future__ import annotations

import signal
from typing import Iterable, Optional

import torch
import torch.distributed as dist


class SignalFlag:
    """Records SIGTERM/SIGINT and the ``extra`` signals (Megatron-LM's --exit-signal, e.g.
    SIGUSR1 from Slurm's --signal); the loop saves and exits at the end of the current step."""

    def __init__(self, enabled: bool, extra: Iterable[int] = ()):
        self.received: Optional[int] = None
        if enabled:
            for sig in {signal.SIGTERM, signal.SIGINT, *extra}:
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def stop_reason(self, device, time_is_up: bool = False):
        """Why to stop now, the same on every rank (collective): "signal" when any rank
        received one, else "time" when any rank's time limit passed, else None. A signal
        sent to one rank only (Slurm may signal one task) is named as such everywhere."""
        code = torch.tensor([2.0 if self.received else 1.0 if time_is_up else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        return {2: "signal", 1: "time"}.get(int(code.item()))
