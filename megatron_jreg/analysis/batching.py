"""How an evaluation set becomes padded batches, on one process or on each DP rank.

One process streams the sequences: consecutive batches of ``batch_size``, each padded to
its longest sequence, progress counted in tokens. Under torchrun every rank reads every
sequence (so a ``--max-tokens`` cut and any input error are the same everywhere); each
data-parallel rank takes every ``dp``-th one, in batches of one shape, ``[batch_size,
width of the longest sequence]`` (rounded up to a multiple of 2 x CP under context
parallelism, times TP under sequence parallelism), as many on every rank (a short rank
runs fully masked batches); the per-layer sums are then added over the world with one
all-reduce (:attr:`MeasureWorld.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_jreg.errors import InputError

NO_TOKENS = (
    "no tokens to evaluate: the input is empty after skipping blank documents; "
    "check --text-file/--jsonl/--data-path"
)

Batch = Tuple[torch.Tensor, torch.Tensor, int]
"""input_ids [b, s] int64, mask [b, s] bool (True on real tokens), progress made."""


def pad_batch(
    sequences: List[List[int]],
    pad_id: int,
    width: Optional[int] = None,
    rows: Optional[int] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest sequence: input_ids [b, s] int64, mask [b, s] bool.

    Right padding keeps every real token at the same position as when it runs alone, so
    with a causal mask a token's states do not depend on its batch-mates. ``width`` and
    ``rows`` fix the shape instead (fully masked rows fill a short batch), as pipeline
    p2p needs.
    """
    width = width if width is not None else max(len(seq) for seq in sequences)
    rows = rows if rows is not None else len(sequences)
    if len(sequences) > rows or any(len(seq) > width for seq in sequences):
        raise ValueError(f"pad_batch: {len(sequences)} sequences do not fit [{rows}, {width}]")
    input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for row, seq in enumerate(sequences):
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = True
    return input_ids, mask


def batches(sequences: Iterable[List[int]], batch_size: int) -> Iterator[List[List[int]]]:
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    batch: List[List[int]] = []
    for seq in sequences:
        batch.append(seq)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


class BatchPlan:
    """This rank's batches of one evaluation set; ``documents`` and ``tokens`` count the
    whole set (every rank's share) once iteration has finished."""

    unit: str = "tok"
    total: Optional[int] = None

    def __init__(self) -> None:
        self.documents = 0
        self.tokens = 0

    def __iter__(self) -> Iterator[Batch]:
        raise NotImplementedError


class _StreamPlan(BatchPlan):
    """One process: consecutive batches, each as wide as its longest sequence."""

    def __init__(self, sequences: Iterable[List[int]], batch_size: int, pad_id: int,
                 max_tokens: Optional[int]):
        super().__init__()
        self._sequences, self._batch_size, self._pad_id = sequences, batch_size, pad_id
        self.total = max_tokens

    def __iter__(self) -> Iterator[Batch]:
        for batch in batches(self._sequences, self._batch_size):
            input_ids, mask = pad_batch(batch, self._pad_id)
            counted = int(mask.sum())
            self.documents += len(batch)
            self.tokens += counted
            yield input_ids, mask, counted


class _ShardPlan(BatchPlan):
    """One DP rank: its every ``dp``-th sequence, batches of one shape on every rank."""

    unit = "batch"

    def __init__(self, sequences: Iterable[List[int]], batch_size: int, pad_id: int,
                 world: "MeasureWorld"):
        super().__init__()
        if batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {batch_size}")
        sequences = list(sequences)
        if not sequences:
            raise InputError(NO_TOKENS)
        self.documents = len(sequences)
        self.tokens = sum(len(seq) for seq in sequences)
        width = max(len(seq) for seq in sequences)
        width = -(-width // world.width_multiple) * world.width_multiple
        per_rank = -(-len(sequences) // world.dp_size)  # DP rank 0 holds the most documents
        self.total = -(-per_rank // batch_size)
        self._mine = sequences[world.dp_rank :: world.dp_size]
        self._width, self._batch_size, self._pad_id = width, batch_size, pad_id

    def __iter__(self) -> Iterator[Batch]:
        size = self._batch_size
        for i in range(self.total):
            input_ids, mask = pad_batch(self._mine[i * size : (i + 1) * size], self._pad_id,
                                        width=self._width, rows=size)
            yield input_ids, mask, 1


@dataclass(frozen=True, kw_only=True)
class MeasureWorld:
    """Where a measurement runs: one process (the default), or one rank of a world."""

    dp_rank: int = 0
    dp_size: int = 1
    width_multiple: int = 1
    """Batch widths are rounded up to this: 2 x CP under context parallelism (the sequence
    splits into 2 x CP equal chunks), times the TP size under sequence parallelism."""
    layout: Optional[Dict[str, Any]] = None
    """The parallel layout, written to the report's ``parallel`` key; None on one process."""

    @property
    def distributed(self) -> bool:
        return self.layout is not None

    def plan(self, sequences: Iterable[List[int]], batch_size: int, pad_id: int,
             max_tokens: Optional[int] = None) -> BatchPlan:
        if not self.distributed:
            return _StreamPlan(sequences, batch_size, pad_id, max_tokens)
        return _ShardPlan(sequences, batch_size, pad_id, self)

    @property
    def groups(self) -> Tuple[None, ...]:
        """The process groups a measurement's sums are added over: the default group (every
        rank of the world: TP, PP, CP and DP) under torchrun, none on one process."""
        return (None,) if self.distributed else ()


ONE_PROCESS = MeasureWorld()


def one_process() -> MeasureWorld:
    return ONE_PROCESS
