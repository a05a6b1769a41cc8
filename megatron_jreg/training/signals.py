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

    def any_rank(self, device, also: bool = False) -> bool:
        """True on every rank when any rank received a signal or passed ``also`` (another
        reason to stop, such as a time limit) (collective)."""
        flag = torch.tensor([1.0 if self.received or also else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
