"""SIGTERM/SIGINT as a request to save and exit at the end of the current step."""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist


class SignalFlag:
    """Records SIGTERM/SIGINT; the loop saves and exits at the end of the current step."""

    def __init__(self, enabled: bool):
        self.received: Optional[int] = None
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.received = signum

    def any_rank(self, device) -> bool:
        """True on every rank when any rank received a signal (collective)."""
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
