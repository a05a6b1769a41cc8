"""Report comparison (Delta_l), trajectories, and the plots."""

from __future__ import annotations

import json
import sys

import pytest

from megatron_jreg.analysis import InputError, JumpReport, compare_reports, load_report
from megatron_jreg.analysis.eval_jump_cli import main
from megatron_jreg.analysis.trajectory import (
    format_trajectory_table,
    sort_trajectory,
    trajectory_to_csv,
)

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


def test_plots_write_png(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_jreg.analysis import plots

    fig2 = tmp_path / "fig2.png"
    plots.plot_displacement([A, B], str(fig2), title="two models")
    fig3 = tmp_path / "fig3.png"
    plots.plot_trajectory([(1000, A), (2000, B)], str(fig3))
    for path in (fig2, fig3):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig2.png", "fig3.png"]


def test_plot_from_reports_via_cli(tmp_path):
    pytest.importorskip("matplotlib")
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(A.to_json())
    pb.write_text(B.to_json())
    png, csv_path = tmp_path / "p.png", tmp_path / "p.csv"
    assert main(["--reports", str(pa), str(pb), "--plot", str(png), "--csv", str(csv_path)]) == 0
    assert png.stat().st_size > 0
    assert len(csv_path.read_text().splitlines()) == 1 + 8


def test_matplotlib_missing_is_a_clear_error(tmp_path, monkeypatch, capsys):
    pa = tmp_path / "a.json"
    pa.write_text(A.to_json())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--reports", str(pa), "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install --no-build-isolation -e \".[plot]\"" in capsys.readouterr().err
