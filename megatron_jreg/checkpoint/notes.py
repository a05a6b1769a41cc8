"""Lines a checkpoint reader prints once per process (rank 0 only)."""

from __future__ import annotations

import torch.distributed as dist

_reported = set()


def report_once(message: str) -> None:
    if message not in _reported and (not dist.is_initialized() or dist.get_rank() == 0):
        print(message, flush=True)
    _reported.add(message)
