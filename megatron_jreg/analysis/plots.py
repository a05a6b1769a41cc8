"""Figures: displacement per layer (Figure 2 style) and its trajectory over a run.

matplotlib is an optional extra, imported here only when a plot is asked for, with the
Agg backend so plotting works without a display. A NaN Psi_l or zeta_L (non-finite
hidden states) is left out of its line (a gap), never drawn as 0.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

from megatron_jreg.analysis.jump_accumulator import JumpReport
from megatron_jreg.atomic_write import write_atomic
from megatron_jreg.errors import missing_extra


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise missing_extra("matplotlib", "plot", "--plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def _save(fig, path: str) -> None:
    fmt = path.rsplit(".", 1)[-1].lower() if "." in path else "png"
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=fmt, dpi=150, bbox_inches="tight"))


def plot_displacement(
    reports: Sequence[JumpReport], path: str, title: Optional[str] = None
) -> None:
    """x = layer 1..L, y = Psi_l, one line per report."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        for report in reports:
            layers = range(1, report.num_layers + 1)
            zeta = report.jump_rate.get("L")
            label = report.model if zeta is None else f"{report.model} (zeta_L={zeta:.3g})"
            ax.plot(layers, report.displacement, marker="o", markersize=3, label=label)
        ax.set_xlabel("layer l")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.set_ylabel("displacement Psi_l")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if title:
            ax.set_title(title)
        _save(fig, path)
    finally:
        plt.close(fig)


def plot_trajectory(
    trajectory: Sequence[Tuple[int, JumpReport]], path: str, title: Optional[str] = None
) -> None:
    """Left: zeta_L per iteration. Right: the displacement curve of every iteration."""
    plt = _pyplot()
    fig, (ax_zeta, ax_psi) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        iterations = [it for it, _ in trajectory]
        zetas = [r.jump_rate.get("L", math.nan) for _, r in trajectory]  # NaN: a gap
        ax_zeta.plot(iterations, zetas, marker="o")
        ax_zeta.set_xlabel("iteration")
        ax_zeta.set_ylabel("jump rate zeta_L")
        ax_zeta.grid(alpha=0.3)
        cmap = plt.get_cmap("viridis")
        for i, (iteration, report) in enumerate(trajectory):
            color = cmap(i / max(1, len(trajectory) - 1))
            ax_psi.plot(
                range(1, report.num_layers + 1),
                report.displacement,
                color=color,
                label=str(iteration),
            )
        ax_psi.set_xlabel("layer l")
        ax_psi.xaxis.set_major_locator(_integer_ticks())
        ax_psi.set_ylabel("displacement Psi_l")
        ax_psi.set_ylim(bottom=0)
        ax_psi.grid(alpha=0.3)
        ax_psi.legend(title="iteration", fontsize=7)
        if title:
            fig.suptitle(title)
        _save(fig, path)
    finally:
        plt.close(fig)
