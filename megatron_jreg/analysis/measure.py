"""Run a hidden-state source over token sequences: batching, padding, progress."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from megatron_jreg.analysis.errors import InputError
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator, JumpReport
from megatron_jreg.analysis.sources import HiddenStateSource


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


def _progress(total: Optional[int], enabled: bool, label: str):
    from tqdm import tqdm

    return tqdm(
        total=total, unit="tok", unit_scale=True, desc=label, disable=not enabled, leave=False
    )


def measure_jump(
    source: HiddenStateSource,
    sequences: Iterable[List[int]],
    *,
    batch_size: int = 8,
    label: Optional[str] = None,
    max_tokens: Optional[int] = None,
    progress: bool = False,
    extra: Optional[Dict[str, Any]] = None,
) -> JumpReport:
    """Psi_1..Psi_L of ``source`` over all real tokens of ``sequences`` (token id lists).

    ``max_tokens`` only sizes the progress bar; cut the sequences with
    ``text_inputs.token_sequences``.
    """
    label = label or source.name
    acc = JumpAccumulator(source.num_layers)
    documents = 0
    with _progress(max_tokens, progress, label) as bar:
        for batch in batches(sequences, batch_size):
            input_ids, mask = pad_batch(batch, source.pad_id)
            source.accumulate(input_ids, mask, acc)
            documents += len(batch)
            bar.update(int(mask.sum()))
    if acc.tokens == 0:
        raise InputError(
            "no tokens to evaluate: the input is empty after skipping blank documents; "
            "check --text-file/--jsonl/--data-path"
        )
    info = {"documents": documents}
    info.update(extra or {})
    return acc.report(label, include_final_norm=source.include_final_norm, extra=info)
