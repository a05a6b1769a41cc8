"""Report comparison (Delta_l), trajectories, and the plots."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_jreg.analysis.compare import compare_reports, load_report
from megatron_jreg.analysis.jump_accumulator import JumpReport
from megatron_jreg.analysis.trajectory import (
    format_trajectory_table,
    sort_trajectory,
    trajectory_to_csv,
)
from megatron_jreg.commands.eval_jump import main
from megatron_jreg.errors import InputError

A = JumpReport(model="baseline", num_layers=4, tokens=100, displacement=[0.10, 0.04, 0.05, 0.30])
B = JumpReport(model="jreg", num_layers=4, tokens=100, displacement=[0.12, 0.05, 0.04, 0.08])


def test_deltas_and_layers_b_moves_more():
    cmp = compare_reports(A, B)
    assert cmp.deltas == pytest.approx([0.02, 0.01, -0.01, -0.22])
    assert cmp.layers_b_moves_more == [1, 2]
    table = cmp.format_table()
    assert "layers where B moves more than A: 1, 2" in table
    assert "    4    0.300000    0.080000   -0.220000" in table
    assert cmp.to_dict()["layers_b_moves_more"] == [1, 2]
    assert cmp.to_csv().splitlines()[0] == "layer,psi_a,psi_b,delta"


def test_compare_needs_same_depth():
    short = JumpReport(model="s", num_layers=2, tokens=1, displacement=[0.1, 0.2])
    with pytest.raises(InputError, match="same depth"):
        compare_reports(A, short)


def test_compare_from_json_files(tmp_path, capsys):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(A.to_json())
    pb.write_text(B.to_json())
    assert load_report(str(pa)) == A
    assert main(["--compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "A: baseline   B: jreg" in out and "layers where B moves more than A: 1, 2" in out
    # A list of one report (eval_jump --json with several models writes lists) also loads.
    pa.write_text(json.dumps([A.to_dict()]))
    assert load_report(str(pa)) == A


def test_trajectory_table_and_csv():
    items = sort_trajectory([(2000, B), (1000, A)])
    assert [it for it, _ in items] == [1000, 2000]
    table = format_trajectory_table(items).splitlines()
    assert table[0].split() == ["iteration", "zeta_L", "zeta_L-1", "zeta_L-2", "Psi_L"]
    assert table[1].split()[:2] == ["1000", f"{A.jump_rate['L']:.4f}"]
    rows = trajectory_to_csv(items).splitlines()
    assert rows[0] == "iteration,model,layer,displacement,jump_rate" and len(rows) == 1 + 8


# ---- plots: the data on the figure, and the PNG it becomes --------------------------------


def _png_image(path, width_range, height_range):
    """The decoded RGBA pixels of ``path`` after checking it is one whole PNG of a plausible size.

    The figures are saved at dpi 150 with a tight bounding box, so a figure of w x h inches
    gives about 150 w x 150 h pixels, less the trimmed margins.
    """
    import struct

    import matplotlib.image as mpimg

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind, width, height = struct.unpack(">I4sII", data[8:24])
    assert (length, kind) == (13, b"IHDR")
    assert data[-12:] == b"\x00\x00\x00\x00IEND\xaeB`\x82"  # ends with its IEND chunk
    assert width_range[0] <= width <= width_range[1], width
    assert height_range[0] <= height <= height_range[1], height
    image = mpimg.imread(str(path))  # decodes every IDAT chunk: a truncated file fails
    assert image.shape == (height, width, 4)
    return image


def _pixels_like(image, color, tol=0.02):
    """How many pixels have ``color`` (a matplotlib colour), to within tol per channel."""
    import numpy as np
    from matplotlib.colors import to_rgb

    return int((np.abs(image[..., :3] - np.array(to_rgb(color))) < tol).all(axis=-1).sum())


def _not_blank(image):
    import numpy as np

    rgb = image[..., :3].reshape(-1, 3)
    assert float(rgb.std()) > 0.05  # a blank (one-colour) canvas has 0
    packed = (np.round(rgb * 255).astype(np.int64) * [65536, 256, 1]).sum(axis=1)
    assert len(np.unique(packed)) > 50  # lines, markers, text, anti-aliasing
    assert float((rgb.sum(axis=1) < 1.5).mean()) > 0.005  # some dark ink: axes, ticks, labels


@pytest.fixture
def figures(monkeypatch):
    """Each figure the plot functions save, recorded as it is handed to plots._save."""
    pytest.importorskip("matplotlib")
    from megatron_jreg.analysis import plots

    saved = []
    real_save = plots._save

    def record(fig, path):
        axes = []
        for ax in fig.axes:
            legend = ax.get_legend()
            axes.append({
                "lines": [(list(map(float, line.get_xdata())), list(map(float, line.get_ydata())),
                           line.get_label(), line.get_color()) for line in ax.lines],
                "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(), "title": ax.get_title(),
                "ylim": ax.get_ylim(),
                "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
            })
        suptitle = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else ""
        saved.append({"path": str(path), "axes": axes, "suptitle": suptitle})
        real_save(fig, path)

    monkeypatch.setattr(plots, "_save", record)
    return saved


def _displacement_label(report):
    return f"{report.model} (zeta_L={report.jump_rate['L']:.3g})"


def _check_displacement_figure(figure, reports, title=None):
    assert len(figure["axes"]) == 1
    ax = figure["axes"][0]
    assert [(x, y, label) for x, y, label, _ in ax["lines"]] == [
        (list(map(float, range(1, r.num_layers + 1))), r.displacement, _displacement_label(r))
        for r in reports
    ]
    assert ax["legend"] == [_displacement_label(r) for r in reports]
    assert len({color for *_, color in ax["lines"]}) == len(reports)  # one colour per model
    assert (ax["xlabel"], ax["ylabel"]) == ("layer l", "displacement Psi_l")
    assert ax["ylim"][0] == 0 and ax["ylim"][1] >= max(max(r.displacement) for r in reports)
    assert ax["title"] == (title or "")


def test_displacement_plot_data_and_png(tmp_path, figures):
    from megatron_jreg.analysis import plots

    fig2 = tmp_path / "fig2.png"
    plots.plot_displacement([A, B], str(fig2), title="two models")
    assert [f["path"] for f in figures] == [str(fig2)]
    _check_displacement_figure(figures[0], [A, B], title="two models")
    image = _png_image(fig2, (600, 950), (400, 650))  # 6 x 4 inches at dpi 150
    _not_blank(image)
    # both lines were drawn, each in its colour (C0, C1 of the default cycle)
    for _, _, _, color in figures[0]["axes"][0]["lines"]:
        assert _pixels_like(image, color) > 200, color
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig2.png"]  # no temporary left


def test_displacement_plots_of_different_reports_differ(tmp_path, figures):
    import numpy as np

    from megatron_jreg.analysis import plots

    images = []
    for report in (A, B):
        path = tmp_path / f"{report.model}.png"
        plots.plot_displacement([report], str(path))
        images.append(_png_image(path, (600, 950), (400, 650)))
        _not_blank(images[-1])
    _check_displacement_figure(figures[0], [A])
    _check_displacement_figure(figures[1], [B])
    a, b = images
    # another size, or the same frame with the curve (and legend) elsewhere
    assert a.shape != b.shape or (
        float(np.abs(a - b).max()) > 0.5 and float((np.abs(a - b) > 0.1).mean()) > 0.002
    )


def test_trajectory_plot_data_and_png(tmp_path, figures):
    from megatron_jreg.analysis import plots

    fig3 = tmp_path / "fig3.png"
    plots.plot_trajectory([(1000, A), (2000, B)], str(fig3), title="run")
    (figure,) = figures
    assert figure["suptitle"] == "run"
    ax_zeta, ax_psi = figure["axes"]
    ((x, y, _, _),) = ax_zeta["lines"]
    assert (x, y) == ([1000.0, 2000.0], [A.jump_rate["L"], B.jump_rate["L"]])
    assert (ax_zeta["xlabel"], ax_zeta["ylabel"]) == ("iteration", "jump rate zeta_L")
    assert [(x, y, label) for x, y, label, _ in ax_psi["lines"]] == [
        ([1.0, 2.0, 3.0, 4.0], A.displacement, "1000"),
        ([1.0, 2.0, 3.0, 4.0], B.displacement, "2000"),
    ]
    assert ax_psi["legend"] == ["1000", "2000"] and ax_psi["ylim"][0] == 0
    colors = [color for *_, color in ax_psi["lines"]]
    assert colors[0] != colors[1]  # the first and last iterations at the two ends of viridis
    image = _png_image(fig3, (1100, 1700), (400, 650))  # 11 x 4 inches at dpi 150
    _not_blank(image)
    for color in colors:
        assert _pixels_like(image, color, tol=0.03) > 100, color
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig3.png"]


def test_plot_from_reports_via_cli(tmp_path, figures):
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(A.to_json())
    pb.write_text(B.to_json())
    png, csv_path = tmp_path / "p.png", tmp_path / "p.csv"
    assert main(["--reports", str(pa), str(pb), "--plot", str(png), "--csv", str(csv_path)]) == 0
    assert [f["path"] for f in figures] == [str(png)]
    _check_displacement_figure(figures[0], [load_report(str(pa)), load_report(str(pb))])
    _not_blank(_png_image(png, (600, 950), (400, 650)))
    assert len(csv_path.read_text().splitlines()) == 1 + 8


def test_matplotlib_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    pa = tmp_path / "a.json"
    pa.write_text(A.to_json())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--reports", str(pa), "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install --no-build-isolation -e \".[plot]\"" in capsys.readouterr().err
