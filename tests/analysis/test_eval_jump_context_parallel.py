"""eval_jump --load under context parallelism: CP2 on two ranks gives the one-process report.

The documents have different lengths (the longest cut at --seq-length 47, an odd width), so
each batch is padded to a multiple of 2 x CP, the padding lands in the CP chunks, and the
hooks see each rank's [s / 2, b, h] states; padding is never counted.
"""

import csv
import json
import os
import subprocess
import sys

import pytest
from checkpoint_runs import REPO, run_env

import forked_trainer
from megatron_jreg.checkpoint.model_loader import check_layout
from megatron_jreg.commands.eval_jump import main
from megatron_jreg.config.model import ParallelConfig
from megatron_jreg.errors import InputError

LENGTHS = [5, 60, 16, 29, 8, 41, 23]  # 60 is cut at SEQ_LENGTH
SEQ_LENGTH = 47
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env():
    env = run_env()  # the repo's own package, whatever an installed copy says
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _eval_jump(launcher, argv, out):
    """eval_jump under ``launcher`` (one forked process for None): (stdout, JSON, CSV rows)."""
    cmd = ["tools/eval_jump.py", *map(str, argv), "--json", str(out / "r.json"),
           "--csv", str(out / "r.csv"), "--no-progress"]
    if launcher is None:
        proc = forked_trainer.run_tool(cmd[0], cmd[1:], _env(), timeout=300)
    else:
        proc = subprocess.run([*launcher, *cmd], cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    with open(out / "r.json") as f:
        report = json.load(f)
    with open(out / "r.csv", newline="") as f:
        return proc.stdout, report, list(csv.DictReader(f))


@pytest.fixture(scope="module")
def uneven_text(tmp_path_factory):
    words = ["jump", "layer", "norm", "token", "state", "model", "the", "of", "a", "residual"]
    docs = []
    for i, n in enumerate(LENGTHS):
        text = ""
        while len(text) < n:
            text += words[(3 * i + len(text)) % len(words)] + " "
        docs.append(text[:n].strip())
    path = tmp_path_factory.mktemp("cp_text") / "eval.txt"
    path.write_text("\n".join(docs) + "\n")
    return str(path), sum(min(len(d), SEQ_LENGTH) for d in docs)  # ByteTokenizer: one per byte


def test_context_parallel_matches_single_process(trained_checkpoints, uneven_text, tmp_path):
    text, tokens = uneven_text
    args = ["--load", trained_checkpoints["tp1"], "--text-file", text,
            "--seq-length", SEQ_LENGTH, "--batch-size", 3]
    (tmp_path / "one").mkdir(), (tmp_path / "cp2").mkdir()
    _, ref, ref_rows = _eval_jump(None, args, tmp_path / "one")
    stdout, report, rows = _eval_jump(TORCHRUN, args + ["--context-parallel-size", 2],
                                      tmp_path / "cp2")
    assert report["tokens"] == ref["tokens"] == tokens  # each token once, no padding
    worst = max(abs(a - b) / abs(b) for a, b in zip(report["displacement"], ref["displacement"]))
    print(f"cp2: Psi_l {report['displacement']}; largest relative difference vs one process "
          f"{worst:.2e}")
    assert report["displacement"] == pytest.approx(ref["displacement"], rel=1e-6)
    assert report["jump_rate_by_layer"] == pytest.approx(ref["jump_rate_by_layer"], rel=1e-6)
    assert report["jump_rate"] == pytest.approx(ref["jump_rate"], rel=1e-6)
    assert report.pop("parallel") == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "context_parallel_size": 2, "data_parallel_size": 1, "sequence_parallel": False}
    numbers = ("displacement", "jump_rate", "jump_rate_by_layer")
    assert {k: v for k, v in report.items() if k not in numbers} == {
        k: v for k, v in ref.items() if k not in numbers}
    # the CSV: the same rows, the same numbers
    assert [(r["model"], r["layer"]) for r in rows] == [(r["model"], r["layer"]) for r in ref_rows]
    for row, ref_row in zip(rows, ref_rows):
        for key in ("displacement", "jump_rate"):
            if ref_row[key]:
                assert float(row[key]) == pytest.approx(float(ref_row[key]), rel=1e-6)
            else:
                assert row[key] == ref_row[key]
    assert stdout.count("model: ") == 1  # rank 0 alone prints the table


def test_context_parallel_layout_refusals(trained_checkpoints, uneven_text, capsys):
    text, _ = uneven_text
    # one process cannot hold CP2; checked before any model is built
    code = main(["--load", trained_checkpoints["tp1"], "--text-file", text,
                 "--context-parallel-size", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--context-parallel-size 2 needs 2 processes" in err
    code = main(["--reports", "x.json", "--context-parallel-size", "2"])
    assert code == 2 and "--context-parallel-size only applies to --load" in capsys.readouterr().err
    with pytest.raises(InputError, match=r"3 processes do not split into .* x "
                                         r"--context-parallel-size 2; .* multiple of 2$"):
        check_layout(ParallelConfig(context_parallel_size=2), 3)
