"""The source-kind registry, exercised by a toy checkpoint kind (a template for --load)."""

from __future__ import annotations

import argparse
import json
from typing import List

import pytest
import torch

from megatron_jreg.analysis import (
    InputError,
    JumpAccumulator,
    SourceEntry,
    SourceKind,
    builtin_source_kinds,
)
from megatron_jreg.commands.eval_jump import main


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


def toy_kind() -> SourceKind:
    def add_arguments(group: argparse._ArgumentGroup) -> None:
        group.add_argument("--load", default=None)
        group.add_argument("--all-iterations", action="store_true")

    def build(args: argparse.Namespace) -> List[SourceEntry]:
        if args.load != "toy-run":
            raise InputError(f"--load {args.load}: no checkpoint there")
        iterations = [100, 200, 300] if args.all_iterations else [300]
        return [
            SourceEntry(
                label=f"toy@{it}",
                iteration=it,
                describe=args.load,
                open=lambda it=it: ToySource(f"toy@{it}", scale=it / 100),
            )
            for it in iterations
        ]

    return SourceKind(
        name="toy",
        flag="--load",
        add_arguments=add_arguments,
        selected=lambda args: bool(args.load),
        build=build,
    )


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a b c d e f\ng h i\nj k l m n o p q\n")
    return path


def test_builtin_kinds():
    assert [k.flag for k in builtin_source_kinds()] == ["--hf-model", "--load"]


def kinds_with_toy():
    """The HF kind beside the toy one (which takes the real checkpoint kind's --load)."""
    return [k for k in builtin_source_kinds() if k.flag != "--load"] + [toy_kind()]


def test_trajectory_through_the_cli(tmp_path, text, capsys):
    kinds = kinds_with_toy()
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
    assert main(argv, kinds=kinds) == 0
    stdout = capsys.readouterr().out
    assert "iteration" in stdout and "zeta_L-2" in stdout
    reports = json.loads(out.read_text())
    assert [r["iteration"] for r in reports] == [100, 200, 300]
    zetas = [r["jump_rate"]["L"] for r in reports]
    assert zetas == sorted(zetas) and zetas[-1] > zetas[0]  # a bigger last update, a bigger jump
    assert csv_path.read_text().splitlines()[0] == "iteration,model,layer,displacement,jump_rate"
    pytest.importorskip("matplotlib")
    png = tmp_path / "traj.png"
    assert main(argv[:-1] + ["--plot", str(png)], kinds=kinds) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_one_kind_per_run_and_kind_errors(tmp_path, text, capsys):
    kinds = kinds_with_toy()
    assert main(["--load", "elsewhere", "--text-file", str(text)], kinds=kinds) == 2
    assert "--load elsewhere: no checkpoint there" in capsys.readouterr().err
    assert (
        main(
            ["--load", "toy-run", "--hf-model", str(tmp_path), "--text-file", str(text)],
            kinds=kinds,
        )
        == 2
    )
    assert "measure one kind of model per run" in capsys.readouterr().err


def test_batching_is_invisible_in_megatron_layout(tmp_path, text):
    kinds = kinds_with_toy()
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
                kinds=kinds,
            )
            == 0
        )
        results.append(json.loads(out.read_text()))
    assert results[0]["tokens"] == results[1]["tokens"] == 6 + 3 + 8
    assert results[0]["displacement"] == pytest.approx(results[1]["displacement"], abs=1e-6)
