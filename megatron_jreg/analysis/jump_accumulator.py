"""Per-layer displacement over a whole evaluation set, and the report it produces.

``Psi_l`` is the mean of ``psi_l`` over every counted token of the set: the accumulator
keeps per-layer sums of ``psi`` and token counts in float64, so the result is the same
however the tokens were batched (never a mean of per-batch means). The sums are
:class:`megatron_jreg.ops.psi_accumulator.PsiAccumulator`'s, the trainer's own.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from megatron_jreg import strict_json
from megatron_jreg.jreg import jump_rates
from megatron_jreg.ops.psi_accumulator import PsiAccumulator

# The keys of the report JSON that every consumer may rely on.
REPORT_KEYS = ("model", "num_layers", "tokens", "displacement", "jump_rate", "include_final_norm")
# Derived keys written for convenience; recomputed, so never read back into ``extra``.
DERIVED_KEYS = ("jump_rate_by_layer",)


class JumpAccumulator(PsiAccumulator):
    """Sums of ``psi_l`` and token counts for layers 1..L over an evaluation set, and the
    report they give.

    A hidden-state source calls :meth:`add` once per layer and batch with the layer's
    input ``h_{l-1}`` and output ``h_l``; a source that already reduced its tokens (a
    pipeline stage, a data-parallel rank) calls :meth:`add_sums`, and accumulators of
    different ranks combine with :meth:`merge` or :meth:`reduce`.
    """

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
