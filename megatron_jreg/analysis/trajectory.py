"""The jump over a run's checkpoints: zeta and Psi per iteration (the paper's Table 2)."""

from __future__ import annotations

import csv
import io
from typing import List, Sequence, Tuple

from megatron_jreg.analysis.jump_accumulator import JumpReport

Trajectory = Sequence[Tuple[int, JumpReport]]  # (iteration, report), in iteration order


def format_trajectory_table(trajectory: Trajectory) -> str:
    """One row per iteration: zeta_L, zeta_{L-1}, zeta_{L-2} and Psi_L."""
    names = list(trajectory[0][1].jump_rate) if trajectory else []
    header = (
        f"{'iteration':>10}  " + "  ".join(f"{'zeta_' + n:>10}" for n in names) + f"  {'Psi_L':>10}"
    )
    lines = [header]
    for iteration, report in trajectory:
        rates = report.jump_rate
        cells = "  ".join(f"{rates[n]:10.4f}" for n in names)
        lines.append(f"{iteration:>10}  {cells}  {report.displacement[-1]:10.6f}")
    return "\n".join(lines)


def trajectory_to_csv(trajectory: Trajectory) -> str:
    """iteration, layer, displacement, jump_rate: the curve of every checkpoint."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["iteration", "model", "layer", "displacement", "jump_rate"])
    for iteration, report in trajectory:
        for row in report.csv_rows():
            writer.writerow([iteration] + row)
    return buf.getvalue()


def sort_trajectory(trajectory: Trajectory) -> List[Tuple[int, JumpReport]]:
    return sorted(trajectory, key=lambda item: item[0])
