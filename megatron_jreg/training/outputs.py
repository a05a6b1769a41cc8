"""The run's outputs checked before any work, the same answer on every rank."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch.distributed as dist

from megatron_jreg.atomic_write import check_output_dir, check_output_path
from megatron_jreg.errors import InputError


def check_outputs(outputs: Sequence[tuple]) -> None:
    """Before any work: rank 0 makes the missing output directories, then every rank
    proves it can write what it writes. The first problem anywhere stops every rank
    with the same one-line error (no rank is left waiting in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def check(create: bool) -> Optional[str]:
        for flag, path, is_dir, every_rank in outputs:
            if not (create or every_rank):
                continue
            try:
                if is_dir:
                    check_output_dir(path, flag, create=create)
                else:
                    check_output_path(path, flag, create=create)
            except InputError as err:
                return str(err)
        return None

    for create in (True, False):
        problem = check(create) if (rank == 0) == create else None
        found: List[Optional[str]] = [None] * world
        dist.all_gather_object(found, problem)
        first = next((p for p in found if p), None)
        if first:
            raise InputError(first)
