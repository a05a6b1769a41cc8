"""Per-layer displacement over a whole evaluation set, and the report it produces.

``Psi_l`` is the mean of ``psi_l`` over every counted token of the set: the accumulator
keeps per-layer sums of ``psi`` and token counts in float64, so the result is the same
however the tokens were batched (never a mean of per-batch means).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_jreg import strict_json
from megatron_jreg.jreg import jump_rates, masked_sum
from megatron_jreg.ops import token_displacement

# The keys of the report JSON that every consumer may rely on.
REPORT_KEYS = ("model", "num_layers", "tokens", "displacement", "jump_rate", "include_final_norm")
# Derived keys written for convenience; recomputed, so never read back into ``extra``.
DERIVED_KEYS = ("jump_rate_by_layer",)


class JumpAccumulator:
    """Sums of ``psi_l`` and token counts for layers 1..L, fed batch by batch.

    A hidden-state source calls :meth:`add` once per layer and batch with the layer's
    input ``h_{l-1}`` and output ``h_l``; a source that already reduced its tokens (a
    pipeline stage, a data-parallel rank) calls :meth:`add_sums`, and accumulators of
    different ranks combine with :meth:`merge`.
    """

    def __init__(self, num_layers: int, impl: str = "auto"):
        if num_layers < 1:
            raise ValueError(f"JumpAccumulator: num_layers must be >= 1, got {num_layers}")
        self.num_layers = num_layers
        self.impl = impl
        self._sums: List[float] = [0.0] * num_layers  # float64 (Python floats)
        self._counts: List[int] = [0] * num_layers
        # (layer, sum, count) of batches added on the device and not yet read: reading them
        # one by one would wait for the GPU inside every layer's forward
        self._pending: List[tuple] = []

    def _flush(self) -> None:
        """Fold the pending device sums into the float64 totals, in the order added (the
        same totals as adding each at once), with one wait for the device."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        # one device: the layers of a model spread by a device map add on their own devices
        device = pending[0][1].device
        totals = torch.stack([total.to(device, torch.float64) for _, total, _ in pending])
        counts = torch.stack([torch.as_tensor(count, dtype=torch.float64, device=device)
                              for _, _, count in pending])  # exact below 2**53 tokens
        for (layer, _, _), (total, count) in zip(pending, torch.stack([totals, counts], 1).tolist()):
            self._sums[layer - 1] += total
            self._counts[layer - 1] += int(count)

    @property
    def psi_sums(self) -> List[float]:
        self._flush()
        return self._sums

    @property
    def counts(self) -> List[int]:
        self._flush()
        return self._counts

    def _check_layer(self, layer: int) -> None:
        if not 1 <= layer <= self.num_layers:
            raise ValueError(f"JumpAccumulator: layer must be in 1..{self.num_layers}, got {layer}")

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
            total = masked_sum(psi.double(), mask)
        except ValueError as err:
            raise ValueError(f"JumpAccumulator.add: {err}") from None
        count = psi.numel() if mask is None else mask.sum()
        self._pending.append((layer, total, count))

    def add_states(
        self, states: Sequence[torch.Tensor], mask: Optional[torch.Tensor] = None
    ) -> None:
        """Add all layers of one batch from the L+1 states h_0..h_L."""
        if len(states) != self.num_layers + 1:
            raise ValueError(
                f"JumpAccumulator.add_states: expected {self.num_layers + 1} states h_0..h_L, "
                f"got {len(states)}"
            )
        for layer in range(1, self.num_layers + 1):
            self.add(layer, states[layer - 1], states[layer], mask)

    def add_sums(self, layer: int, psi_sum: float, count: int) -> None:
        """Add an already reduced sum of ``psi_l`` over ``count`` tokens."""
        self._check_layer(layer)
        if count < 0:
            raise ValueError(f"JumpAccumulator.add_sums: count must be >= 0, got {count}")
        self._flush()
        self._sums[layer - 1] += float(psi_sum)
        self._counts[layer - 1] += int(count)

    def merge(self, other: "JumpAccumulator") -> None:
        """Add another accumulator's sums (e.g. from another data-parallel rank)."""
        if other.num_layers != self.num_layers:
            raise ValueError(
                f"JumpAccumulator.merge: {other.num_layers} layers into {self.num_layers}"
            )
        for layer in range(1, self.num_layers + 1):
            self.add_sums(layer, other.psi_sums[layer - 1], other.counts[layer - 1])

    @property
    def tokens(self) -> int:
        """The number of counted tokens (the same for every layer once a batch is complete)."""
        if len(set(self.counts)) != 1:
            raise RuntimeError(
                f"JumpAccumulator: layers saw different token counts {self.counts}; "
                "a source must add every layer of every batch"
            )
        return self.counts[0]

    def displacement(self) -> List[float]:
        """Psi_1..Psi_L, the mean psi over all counted tokens."""
        tokens = self.tokens
        if tokens == 0:
            raise ValueError("JumpAccumulator: no tokens were counted; nothing to average")
        return [s / tokens for s in self.psi_sums]

    def report(
        self,
        model: str,
        include_final_norm: bool = False,
        extra: Optional[Dict[str, Any]] = None,
    ) -> "JumpReport":
        return JumpReport(
            model=model,
            num_layers=self.num_layers,
            tokens=self.tokens,
            displacement=self.displacement(),
            include_final_norm=include_final_norm,
            extra=dict(extra or {}),
        )


def _jump_rate_keys(num_layers: int) -> Dict[str, int]:
    """{"L": L, "L-1": L-1, "L-2": L-2} restricted to the layers where zeta exists (>= 2)."""
    keys = {"L": num_layers, "L-1": num_layers - 1, "L-2": num_layers - 2}
    return {name: layer for name, layer in keys.items() if layer >= 2}


@dataclass(kw_only=True)
class JumpReport:
    """The displacement of one model on one evaluation set."""

    model: str
    """A label for the model (a directory name, a run name with its iteration)."""
    num_layers: int
    """L, the number of Transformer layers."""
    tokens: int
    """The number of counted tokens every Psi_l averages over."""
    displacement: List[float]
    """Psi_1..Psi_L."""
    include_final_norm: bool = False
    """True when h_L had the model's final norm applied (as HF output_hidden_states does)."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Any further JSON-serialisable keys, written at the top level of the JSON."""

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"JumpReport: num_layers must be >= 1, got {self.num_layers}")
        if len(self.displacement) != self.num_layers:
            raise ValueError(
                f"JumpReport: {len(self.displacement)} displacements for {self.num_layers} layers"
            )
        if self.tokens < 0:
            raise ValueError(f"JumpReport: tokens must be >= 0, got {self.tokens}")
        clash = sorted(set(self.extra) & set(REPORT_KEYS + DERIVED_KEYS))
        if clash:
            raise ValueError(
                f"JumpReport: extra keys {clash} would overwrite the report's own keys"
            )
        self.displacement = [float(p) for p in self.displacement]

    @property
    def jump_rates_by_layer(self) -> Dict[int, float]:
        """{l: zeta_l} for l = 2..L."""
        return jump_rates(self.displacement)

    @property
    def jump_rate(self) -> Dict[str, float]:
        """{"L": zeta_L, "L-1": zeta_{L-1}, "L-2": zeta_{L-2}}, the ones that exist."""
        rates = self.jump_rates_by_layer
        return {name: rates[layer] for name, layer in _jump_rate_keys(self.num_layers).items()}

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "model": self.model,
            "num_layers": self.num_layers,
            "tokens": self.tokens,
            "displacement": list(self.displacement),
            "jump_rate": self.jump_rate,
            "include_final_norm": self.include_final_norm,
            "jump_rate_by_layer": {str(l): z for l, z in self.jump_rates_by_layer.items()},
        }
        out.update(self.extra)
        return out

    def to_json(self, indent: int = 2) -> str:
        """Strict JSON: a NaN displacement or jump rate is written as null."""
        return strict_json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "JumpReport":
        """Read a report written by :meth:`to_dict`; ``ValueError`` names a missing key.

        A null displacement (how the JSON writes a NaN) reads back as NaN.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a jump report must be a JSON object, got {type(data).__name__}")
        missing = [k for k in REPORT_KEYS if k not in data]
        if missing:
            raise ValueError(f"not a jump report: missing keys {missing}")
        extra = {k: v for k, v in data.items() if k not in REPORT_KEYS + DERIVED_KEYS}
        return cls(
            model=str(data["model"]),
            num_layers=int(data["num_layers"]),
            tokens=int(data["tokens"]),
            displacement=[math.nan if p is None else float(p) for p in data["displacement"]],
            include_final_norm=bool(data["include_final_norm"]),
            extra=extra,
        )

    def csv_rows(self) -> List[List[Any]]:
        """Rows of (model, layer, displacement, jump_rate); zeta_1 does not exist."""
        rates = self.jump_rates_by_layer
        return [
            [self.model, layer, repr(psi), repr(rates[layer]) if layer in rates else ""]
            for layer, psi in enumerate(self.displacement, start=1)
        ]

    def to_csv(self) -> str:
        return reports_to_csv([self])

    def format_table(self) -> str:
        """The human-readable table eval_jump prints."""
        rates = self.jump_rates_by_layer
        norm = "with final norm" if self.include_final_norm else "before final norm"
        lines = [
            f"model: {self.model}   layers: {self.num_layers}   tokens: {self.tokens}   "
            f"h_L: {norm}",
            f"{'layer':>5}  {'Psi_l':>10}  {'zeta_l':>9}",
        ]
        for layer, psi in enumerate(self.displacement, start=1):
            zeta = f"{rates[layer]:9.4f}" if layer in rates else f"{'-':>9}"
            lines.append(f"{layer:>5}  {psi:10.6f}  {zeta}")
        summary = "   ".join(
            f"zeta_{{{name}}} = {value:.4f}" if name != "L" else f"zeta_L = {value:.4f}"
            for name, value in self.jump_rate.items()
        )
        lines.append(summary if summary else "zeta: undefined for a single layer")
        return "\n".join(lines)


def reports_to_csv(reports: Sequence[JumpReport]) -> str:
    """One CSV for several reports: a header and one row per (model, layer)."""
    import csv

    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["model", "layer", "displacement", "jump_rate"])
    for report in reports:
        writer.writerows(report.csv_rows())
    return buf.getvalue()
