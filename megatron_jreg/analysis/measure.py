"""Run a hidden-state source over token sequences: batching, progress, the report.

The one measurement path of every source (HF models, our checkpoints on one process or
under torchrun): the source adds each batch's per-layer sums to a JumpAccumulator, the
accumulator adds them up over the world's ranks (nothing to do on one process).
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from megatron_jreg.analysis.batching import (
    NO_TOKENS,
    ONE_PROCESS,
    MeasureWorld,
    batches,
    pad_batch,
)
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator, JumpReport
from megatron_jreg.analysis.sources import HiddenStateSource
from megatron_jreg.errors import InputError
from megatron_jreg.platform.device import collective_device

__all__ = ["measure_jump", "pad_batch", "batches"]  # pad_batch, batches: from batching


def _progress(total: Optional[int], unit: str, enabled: bool, label: str):
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=unit == "tok", desc=label,
                disable=not enabled, leave=False)


def measure_jump(
    source: HiddenStateSource,
    sequences: Iterable[List[int]],
    *,
    batch_size: int = 8,
    label: Optional[str] = None,
    max_tokens: Optional[int] = None,
    progress: bool = False,
    extra: Optional[Dict[str, Any]] = None,
    world: MeasureWorld = ONE_PROCESS,
) -> JumpReport:
    """Psi_1..Psi_L of ``source`` over all real tokens of ``sequences`` (token id lists).

    ``max_tokens`` only sizes the progress bar; cut the sequences with
    ``text_inputs.token_sequences``. Under torchrun (``world``) every rank passes every
    sequence and gets the same report.
    """
    label = label or source.name
    plan = world.plan(sequences, batch_size, source.pad_id, max_tokens)
    acc = JumpAccumulator(source.num_layers)
    with _progress(plan.total, plan.unit, progress, label) as bar:
        for input_ids, mask, step in plan:
            source.accumulate(input_ids, mask, acc)
            bar.update(step)
    if plan.tokens == 0:
        raise InputError(NO_TOKENS)
    total = acc.reduce(world.groups, device=collective_device() if world.groups else None)
    if total.counts != [plan.tokens] * total.num_layers:
        raise RuntimeError(
            f"{label}: the layers counted {total.counts} tokens, expected {plan.tokens} each; "
            "a decoder layer was skipped or measured twice"
        )
    info: Dict[str, Any] = {"documents": plan.documents}
    info.update(extra or {})
    if world.layout is not None:
        info["parallel"] = dict(world.layout)
    return total.report(label, include_final_norm=source.include_final_norm, extra=info)
