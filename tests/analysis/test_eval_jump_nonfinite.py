"""A model with non-finite hidden states: NaN stays NaN everywhere, and the user is told.

Tables and CSV print ``nan``, the JSON holds ``null`` (strict JSON), plots leave a gap,
and eval_jump exits 3 with one line naming the model and the layers, after writing.
"""

from __future__ import annotations

import csv
import json
import math
import os
import shutil

import pytest
import torch

from megatron_jreg.analysis.compare import compare_reports, load_report
from megatron_jreg.analysis.jump_accumulator import JumpReport
from megatron_jreg.analysis.trajectory import format_trajectory_table, trajectory_to_csv
from megatron_jreg.commands.eval_jump import main

NAN = float("nan")
A = JumpReport(model="baseline", num_layers=4, tokens=100, displacement=[0.10, 0.04, 0.05, 0.30])
BAD = JumpReport(model="diverged", num_layers=4, tokens=100, displacement=[NAN] * 4)


def _reject_constant(name):
    raise ValueError(f"not strict JSON: bare {name}")


def strict_loads(text: str):
    """json.loads that refuses the bare NaN/Infinity words Python's json writes."""
    return json.loads(text, parse_constant=_reject_constant)


@pytest.fixture(scope="module")
def nan_hf_model(tiny_hf_model, tmp_path_factory) -> str:
    """The tiny Llama of conftest with every weight NaN (a diverged run)."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path_factory.mktemp("nan") / "nan-llama")
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(NAN)
    model.save_pretrained(path)
    for name in os.listdir(tiny_hf_model):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_hf_model, name), path)
    return path


def test_nan_model_writes_nan_and_null_then_exits_3(nan_hf_model, eval_text, tmp_path, capsys):
    out_json, out_csv = tmp_path / "r.json", tmp_path / "r.csv"
    rc = main(
        [
            "--hf-model", nan_hf_model, "--text-file", eval_text, "--no-progress",
            "--json", str(out_json), "--csv", str(out_csv),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 3, captured.err
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("eval_jump: error: non-finite hidden states")
    assert "nan-llama" in err and os.path.abspath(nan_hf_model) in err
    assert "layers 1-3 of 3" in err
    # the table: nan, never zeta_L = 0.0000
    assert "zeta_L = nan" in captured.out and "0.0000" not in captured.out
    # the JSON, written before the exit: strict, with null for every NaN
    report = strict_loads(out_json.read_text())
    assert report["displacement"] == [None, None, None]
    assert report["jump_rate"] == {"L": None, "L-1": None}
    assert report["jump_rate_by_layer"] == {"2": None, "3": None}
    assert report["tokens"] > 0
    # and it reads back as NaN
    back = load_report(str(out_json))
    assert all(math.isnan(p) for p in back.displacement)
    assert all(math.isnan(z) for z in back.jump_rate.values())
    # the CSV: nan, and no layer's jump rate is 0
    rows = list(csv.DictReader(out_csv.read_text().splitlines()))
    assert [r["displacement"] for r in rows] == ["nan"] * 3
    assert [r["jump_rate"] for r in rows] == ["", "nan", "nan"]


def test_finite_model_exits_0(tiny_hf_model, eval_text, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--hf-model", tiny_hf_model, "--text-file", eval_text, "--no-progress",
               "--json", str(out)])
    assert rc == 0 and capsys.readouterr().err == ""
    assert all(isinstance(p, float) for p in strict_loads(out.read_text())["displacement"])


def test_report_json_is_strict_and_round_trips():
    partial = JumpReport(model="p", num_layers=4, tokens=5, displacement=[0.1, NAN, 0.2, 0.3])
    data = strict_loads(partial.to_json())
    assert data["displacement"] == [0.1, None, 0.2, 0.3]
    # zeta_L and zeta_{L-1} do not involve Psi_2; zeta_{L-2} = zeta_2 does
    assert data["jump_rate"]["L"] == pytest.approx(10.0) and data["jump_rate"]["L-2"] is None
    back = JumpReport.from_dict(data)
    assert math.isnan(back.displacement[1]) and back.displacement[3] == 0.3


def test_compare_with_a_nan_report(tmp_path, capsys):
    cmp = compare_reports(A, BAD)
    assert all(math.isnan(d) for d in cmp.deltas)
    assert cmp.layers_b_moves_more == []
    table = cmp.format_table()
    assert "+nan" not in table and "zeta_L: A 25.0000   B nan" in table
    assert "    4    0.300000         nan         nan" in table
    assert cmp.to_csv().splitlines()[1] == "1,0.1,nan,nan"
    # through the CLI, from JSON files: nan in the table, and loaded reports are not measured
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(A.to_json())
    pb.write_text(BAD.to_json())
    assert main(["--compare", str(pa), str(pb)]) == 0
    out = capsys.readouterr().out
    assert "zeta_L = nan" in out and "B nan" in out


def test_trajectory_with_a_nan_checkpoint():
    items = [(1000, A), (2000, BAD)]
    table = format_trajectory_table(items).splitlines()
    assert table[2].split() == ["2000", "nan", "nan", "nan", "nan"]
    rows = trajectory_to_csv(items).splitlines()
    assert rows[-1] == "2000,diverged,4,nan,nan"
    assert "0.0" not in "".join(rows[5:])


def test_plots_leave_nan_out(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from megatron_jreg.analysis import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    one_layer = JumpReport(model="one", num_layers=1, tokens=1, displacement=[0.2])
    plots.plot_trajectory([(1000, A), (2000, BAD), (3000, one_layer)], str(tmp_path / "t.png"))
    zeta_line = figures[-1].axes[0].lines[0]
    zetas = list(zeta_line.get_ydata())
    assert zetas[0] == pytest.approx(A.jump_rate["L"])
    assert math.isnan(zetas[1])  # the NaN checkpoint: a gap, not 0
    assert math.isnan(zetas[2])  # zeta_L does not exist for one layer: not 0 either
    plots.plot_displacement([A, BAD], str(tmp_path / "d.png"))
    ax = figures[-1].axes[0]
    assert all(math.isnan(y) for y in ax.lines[1].get_ydata())
    assert "zeta_L=nan" in ax.lines[1].get_label()
