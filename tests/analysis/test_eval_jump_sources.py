"""eval_jump's choice of models, exercised by a toy checkpoint source standing in for --load."""

from __future__ import annotations

import json
from typing import List

import pytest
import torch

from megatron_jreg.analysis import checkpoint_source
from megatron_jreg.analysis.checkpoint_source import CheckpointSourceFlags
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.analysis.sources import SourceEntry
from megatron_jreg.commands.eval_jump import build_parser, main
from megatron_jreg.errors import InputError


class ToySource:
    """L residual layers whose update grows with the 'iteration'; states in [s, b, h]."""

    include_final_norm = False
    vocab_size = 50
    pad_id = 0

    def __init__(self, name: str, scale: float, num_layers: int = 4):
        self.name, self.scale, self.num_layers = name, scale, num_layers
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(self.vocab_size, 8, generator=gen)
        self.updates = [torch.randn(8, 8, generator=gen) for _ in range(num_layers)]

    def tokenize(self, text: str) -> List[int]:
        return [1 + sum(map(ord, w)) % (self.vocab_size - 1) for w in text.split()]

    def accumulate(self, input_ids, mask, acc: JumpAccumulator) -> None:
        h = self.embed[input_ids].transpose(0, 1)  # [s, b, h], as Megatron lays it out
        for layer, update in enumerate(self.updates, start=1):
            weight = self.scale if layer == self.num_layers else 0.1
            h_next = h + weight * torch.tanh(h @ update)
            acc.add(layer, h, h_next, mask.t())  # the mask follows the states' layout
            h = h_next


def toy_entries(flags: CheckpointSourceFlags, **run) -> List[SourceEntry]:
    """A toy run in place of checkpoint_source.checkpoint_entries: --load toy-run."""
    load = " ".join(flags.load)
    if load != "toy-run":
        raise InputError(f"--load {load}: no checkpoint there")
    iterations = [100, 200, 300] if flags.all_iterations else [300]
    return [
        SourceEntry(
            label=f"toy@{it}",
            iteration=it,
            describe=load,
            open=lambda it=it: ToySource(f"toy@{it}", scale=it / 100),
        )
        for it in iterations
    ]


@pytest.fixture
def toy_load(monkeypatch):
    """--load measures the toy run; --hf-model stays the real one."""
    monkeypatch.setattr(checkpoint_source, "checkpoint_entries", toy_entries)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b c d e f\ng h i\nj k l m n o p q\n")
    return path


def test_both_kinds_of_model():
    group = next(g for g in build_parser()._action_groups
                 if g.title == "model to measure (one kind)")
    flags = [a.option_strings[0] for a in group._group_actions]
    assert [f for f in flags if f in ("--hf-model", "--load")] == ["--hf-model", "--load"]


def test_trajectory_through_the_cli(tmp_path, text, capsys, toy_load):
    out, csv_path = tmp_path / "traj.json", tmp_path / "traj.csv"
    argv = [
        "--load",
        "toy-run",
        "--all-iterations",
        "--text-file",
        str(text),
        "--batch-size",
        "2",
        "--json",
        str(out),
        "--csv",
        str(csv_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "iteration" in stdout and "zeta_L-2" in stdout
    reports = json.loads(out.read_text())
    assert [r["iteration"] for r in reports] == [100, 200, 300]
    zetas = [r["jump_rate"]["L"] for r in reports]
    assert zetas == sorted(zetas) and zetas[-1] > zetas[0]  # a bigger last update, a bigger jump
    assert csv_path.read_text().splitlines()[0] == "iteration,model,layer,displacement,jump_rate"
    pytest.importorskip("matplotlib")
    png = tmp_path / "traj.png"
    assert main(argv[:-1] + ["--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_one_kind_per_run_and_kind_errors(tmp_path, text, capsys, toy_load):
    assert main(["--load", "elsewhere", "--text-file", str(text)]) == 2
    assert "--load elsewhere: no checkpoint there" in capsys.readouterr().err
    assert (
        main(
            ["--load", "toy-run", "--hf-model", str(tmp_path), "--text-file", str(text)],
        )
        == 2
    )
    assert "measure one kind of model per run" in capsys.readouterr().err


def test_batching_is_invisible_in_megatron_layout(tmp_path, text, toy_load):
    results = []
    for batch_size in ("1", "3"):
        out = tmp_path / f"b{batch_size}.json"
        assert (
            main(
                [
                    "--load",
                    "toy-run",
                    "--text-file",
                    str(text),
                    "--batch-size",
                    batch_size,
                    "--json",
                    str(out),
                    "--no-progress",
                ],
            )
            == 0
        )
        results.append(json.loads(out.read_text()))
    assert results[0]["tokens"] == results[1]["tokens"] == 6 + 3 + 8
    assert results[0]["displacement"] == pytest.approx(results[1]["displacement"], abs=1e-6)
