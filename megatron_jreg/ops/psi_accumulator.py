"""Per-layer sums of psi and their counts, kept on the device and reduced over process groups.

The one accumulator of Psi_l: the trainer's tracker (``model.jreg_layer``) adds each
micro-batch's Psi_l (this rank's share) with a count of one, eval_jump each batch's sum of psi
with its number of counted tokens. Psi_l is the sum over ranks of the sums divided by the sum
over ranks of the counts.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron_jreg.jreg import masked_sum
from megatron_jreg.ops.context_chunks import local_part
from megatron_jreg.ops.displacement import token_displacement

Number = Union[int, float, torch.Tensor]


# Counting once. The data gives a [b, s] token mask; a rank's hidden states are [s, b, h],
# [s / tp, b, h] under sequence parallelism, and under context parallelism two of 2·CP chunks,
# [s / cp, b, h], split further over TP under SP (local_token_mask slices the mask the same
# way). A chunk of split tokens is its rank's own; replicated tokens (TP without SP) are TP
# rank 0's (owns_tokens). A micro-batch as a unit is counted by TP rank 0 of CP rank 0. Each
# layer lives on one pipeline stage and DP ranks hold disjoint batches, so summing the shares
# over the TP, PP and DP-with-CP groups (PsiAccumulator.reduce) counts every token once.
def local_token_mask(mask: torch.Tensor, sequence_parallel: bool, tp_rank: int = 0,
                     tp_size: int = 1, cp_size: int = 1, cp_rank: int = 0) -> torch.Tensor:
    """``mask`` [b, s] -> this rank's [s_local, b] (contiguous): the whole sequence, or the
    CP rank's two chunks of it (:func:`megatron_jreg.ops.context_chunks.local_part`), then
    the TP rank's chunk of those under sequence parallelism. The full mask is known on every
    rank, so no communication is needed."""
    local = local_part(mask, 1, cp_size, cp_rank).t()  # [s / cp, b]
    if sequence_parallel and tp_size > 1:
        local = local.chunk(tp_size, dim=0)[tp_rank]  # [s / cp / tp, b]
    return local.contiguous()


def owns_tokens(sequence_parallel: bool, tp_rank: int) -> bool:
    """Whether this TP rank adds the psi of the tokens it holds: its own chunk under
    sequence parallelism; without it the TP ranks hold the same tokens and rank 0 adds them."""
    return sequence_parallel or tp_rank == 0


class PsiAccumulator:
    """Sums of ``psi_l`` and counts for layers 1..L, one row each of a ``[2, L]`` tensor on
    the device of the first value added.

    Adding never waits for the device; :attr:`psi_sums` and :attr:`counts` read both rows
    with one transfer. Sums are in ``dtype`` (float64 by default; the token counts are
    exact below 2**53).
    """

    def __init__(self, num_layers: int, impl: str = "auto", dtype: torch.dtype = torch.float64):
        if num_layers < 1:
            raise ValueError(f"{self._name}: num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.impl = impl
        self.dtype = dtype
        self._stats: Optional[torch.Tensor] = None  # [2, L]: sums, counts
        self._host: Optional[Tuple[List[float], List[int]]] = None  # the last read of _stats

    @property
    def _name(self) -> str:
        return type(self).__name__

    def _check_layer(self, layer: int) -> None:
        if not 1 <= layer <= self.num_layers:
            raise ValueError(f"{self._name}: layer must be in 1..{self.num_layers}, got {layer}")

    # ---- adding ---------------------------------------------------------------------------
    @torch.no_grad()
    def add(
        self,
        layer: int,
        h_prev: torch.Tensor,
        h_next: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Add one batch of layer ``layer`` (1-based): h_prev = h_{l-1}, h_next = h_l.

        h_prev, h_next: [..., h] in any layout ([b, s, h] or Megatron's [s, b, h]), in any
        dtype and on any devices (h_prev and the mask are moved to h_next's); psi is fp32.
        mask: bool of the token shape [...] (True = counted; padding is False), or None.
        """
        self._check_layer(layer)
        # a pair from a model spread over devices is combined on h_next's device
        h_prev = h_prev.detach().to(h_next.device)
        if mask is not None:
            mask = mask.to(h_next.device)
        psi = token_displacement(h_prev, h_next.detach(), impl=self.impl)  # [...] fp32
        try:
            total = masked_sum(psi.to(self.dtype), mask)
        except ValueError as err:
            raise ValueError(f"{self._name}.add: {err}") from None
        self.add_sums(layer, total, psi.numel() if mask is None else mask.sum())

    def add_states(
        self, states: Sequence[torch.Tensor], mask: Optional[torch.Tensor] = None
    ) -> None:
        """Add all layers of one batch from the L+1 states h_0..h_L."""
        if len(states) != self.num_layers + 1:
            raise ValueError(
                f"{self._name}.add_states: expected {self.num_layers + 1} states h_0..h_L, "
                f"got {len(states)}"
            )
        for layer in range(1, self.num_layers + 1):
            self.add(layer, states[layer - 1], states[layer], mask)

    def add_sums(self, layer: int, psi_sum: Number, count: Number) -> None:
        """Add a sum of ``psi_l`` over ``count`` tokens (or micro-batches): numbers, or
        0-dim tensors on any device (added there without waiting for them)."""
        self._check_layer(layer)
        if not isinstance(count, torch.Tensor) and count < 0:
            raise ValueError(f"{self._name}.add_sums: count must be >= 0, got {count}")
        if self._stats is None:
            device = psi_sum.device if isinstance(psi_sum, torch.Tensor) else None
            self._stats = torch.zeros(2, self.num_layers, dtype=self.dtype, device=device)
        for row, value in enumerate((psi_sum, count)):
            if isinstance(value, torch.Tensor):
                value = value.detach().to(self._stats.device, self.dtype)
            self._stats[row, layer - 1] += value
        self._host = None

    def merge(self, other: "PsiAccumulator") -> None:
        """Add another accumulator's sums (e.g. from another data-parallel rank)."""
        if other.num_layers != self.num_layers:
            raise ValueError(
                f"{self._name}.merge: {other.num_layers} layers into {self.num_layers}"
            )
        for layer in range(1, self.num_layers + 1):
            self.add_sums(layer, other.psi_sums[layer - 1], other.counts[layer - 1])

    def reset(self) -> None:
        self._stats, self._host = None, None

    # ---- reading --------------------------------------------------------------------------
    def _read(self) -> Tuple[List[float], List[int]]:
        if self._host is None:
            if self._stats is None:
                sums, counts = [0.0] * self.num_layers, [0.0] * self.num_layers
            else:
                sums, counts = self._stats.tolist()  # one wait for the device
            self._host = (sums, [int(c) for c in counts])
        return self._host

    @property
    def psi_sums(self) -> List[float]:
        return self._read()[0]

    @property
    def counts(self) -> List[int]:
        return self._read()[1]

    @property
    def tokens(self) -> int:
        """The number of counted tokens (the same for every layer once a batch is complete)."""
        counts = self.counts
        if len(set(counts)) != 1:
            raise RuntimeError(
                f"{self._name}: layers saw different token counts {counts}; "
                "a source must add every layer of every batch"
            )
        return counts[0]

    def displacement(self) -> List[float]:
        """Psi_1..Psi_L, the mean psi over all counted tokens."""
        tokens = self.tokens
        if tokens == 0:
            raise ValueError(f"{self._name}: no tokens were counted; nothing to average")
        return [s / tokens for s in self.psi_sums]

    def means(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """[L] sums / counts on the device, without a wait; a layer counted nowhere gives 0."""
        stats = self._stats
        if stats is None:
            stats = torch.zeros(2, self.num_layers, dtype=self.dtype, device=device)
        return stats[0] / stats[1].clamp(min=1.0)

    # ---- collective -----------------------------------------------------------------------
    def reduce(self, groups: Sequence[Optional[object]],
               device: Optional[torch.device] = None) -> "PsiAccumulator":
        """The sums and counts added over the ranks of each of ``groups`` in turn (process
        groups; None is the default group), as a new accumulator.

        Collective: every rank of the groups calls it with the same groups. ``device`` is
        where the collective's tensor lives (the backend's device); a rank that added
        nothing contributes zeros. No groups: a copy of this rank's sums.
        """
        stats = self._stats
        if stats is None:
            stats = torch.zeros(2, self.num_layers, dtype=self.dtype, device=device)
        stats = stats.to(device) if device is not None else stats
        stats = stats.clone()
        for group in groups:
            dist.all_reduce(stats, group=group)
        total = type(self)(self.num_layers, impl=self.impl, dtype=self.dtype)
        total._stats = stats
        return total
