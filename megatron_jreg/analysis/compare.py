"""Per-layer difference of two models' displacement: Delta_l = Psi_l(B) - Psi_l(A)."""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List

from megatron_jreg.analysis.jump_accumulator import JumpReport
from megatron_jreg.errors import InputError


def load_report(path: str) -> JumpReport:
    """A JumpReport from a JSON file written by ``eval_jump --json`` (one object)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise InputError(
            f"{path}: no such report file; give a JSON written by eval_jump --json"
        ) from None
    except IsADirectoryError:
        raise InputError(
            f"{path}: is a directory; give a JSON written by eval_jump --json"
        ) from None
    except json.JSONDecodeError as e:
        raise InputError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}); "
            "give a report written by eval_jump --json"
        ) from None
    reports = data if isinstance(data, list) else [data]
    if len(reports) != 1:
        raise InputError(f"{path}: holds {len(reports)} reports; give a file with one report")
    try:
        return JumpReport.from_dict(reports[0])
    except (ValueError, TypeError) as e:
        raise InputError(f"{path}: {e}; give a report written by eval_jump --json") from None


@dataclass(kw_only=True)
class ReportComparison:
    """B against A, layer by layer (the paper's Table 5)."""

    a: JumpReport
    b: JumpReport

    def __post_init__(self) -> None:
        if self.a.num_layers != self.b.num_layers:
            raise InputError(
                f"cannot compare {self.a.model} ({self.a.num_layers} layers) with "
                f"{self.b.model} ({self.b.num_layers} layers); Delta_l needs the same depth"
            )

    @property
    def deltas(self) -> List[float]:
        """Delta_1..Delta_L."""
        return [pb - pa for pa, pb in zip(self.a.displacement, self.b.displacement)]

    @property
    def layers_b_moves_more(self) -> List[int]:
        """The layers (1-based) where B's displacement exceeds A's (a NaN Delta is not)."""
        return [layer for layer, d in enumerate(self.deltas, start=1) if d > 0]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "a": self.a.model,
            "b": self.b.model,
            "num_layers": self.a.num_layers,
            "delta": self.deltas,
            "layers_b_moves_more": self.layers_b_moves_more,
            "jump_rate_a": self.a.jump_rate,
            "jump_rate_b": self.b.jump_rate,
        }

    def to_csv(self) -> str:
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["layer", "psi_a", "psi_b", "delta"])
        for layer, (pa, pb) in enumerate(zip(self.a.displacement, self.b.displacement), start=1):
            writer.writerow([layer, repr(pa), repr(pb), repr(pb - pa)])
        return buf.getvalue()

    def format_table(self) -> str:
        lines = [
            f"A: {self.a.model}   B: {self.b.model}   Delta_l = Psi_l(B) - Psi_l(A)",
            f"{'layer':>5}  {'Psi_l(A)':>10}  {'Psi_l(B)':>10}  {'Delta_l':>10}",
        ]
        for layer, (pa, pb) in enumerate(zip(self.a.displacement, self.b.displacement), start=1):
            mark = "  B moves more" if pb > pa else ""
            delta = pb - pa
            # a NaN Delta prints as "nan" (format's "+" would write "+nan")
            delta_text = f"{delta:10.6f}" if math.isnan(delta) else f"{delta:+10.6f}"
            lines.append(f"{layer:>5}  {pa:10.6f}  {pb:10.6f}  {delta_text}{mark}")
        more = self.layers_b_moves_more
        lines.append(
            f"layers where B moves more than A: {', '.join(map(str, more)) if more else 'none'}"
        )
        za, zb = self.a.jump_rate.get("L"), self.b.jump_rate.get("L")
        if za is not None:
            lines.append(f"zeta_L: A {za:.4f}   B {zb:.4f}")
        return "\n".join(lines)


def compare_reports(a: JumpReport, b: JumpReport) -> ReportComparison:
    return ReportComparison(a=a, b=b)


def format_summary_table(reports: List[JumpReport]) -> str:
    """One row per model, its jump rates of the last three layers: the layout of the
    paper's Tables 4 and 7. A rate that is not finite prints as nan, never as a number."""
    names = [n for n in ("L", "L-1", "L-2") if any(n in r.jump_rate for r in reports)]
    width = max([len("model")] + [len(r.model) for r in reports])
    header = f"{'model':<{width}}  " + "  ".join(f"{'zeta_' + n:>9}" for n in names)
    lines = [header]
    for r in reports:
        cells = [f"{r.jump_rate[n]:9.4f}" if n in r.jump_rate else f"{'-':>9}" for n in names]
        lines.append(f"{r.model:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)

