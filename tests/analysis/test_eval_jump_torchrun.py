"""eval_jump --load under torchrun: TP, TP+SP, PP, DP and CP layouts give the one-process
numbers.

The documents have different lengths, so right padding, the fixed batch width (rounded up
for sequence parallelism) and the fully masked batch of the shorter DP rank all run.
"""

import csv
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from checkpoint_runs import REPO, run_env

import forked_trainer
from megatron_jreg.checkpoint.model_loader import check_layout, check_model_split
from megatron_jreg.commands.eval_jump import main
from megatron_jreg.config.model import ParallelConfig
from megatron_jreg.errors import InputError

# seven documents (DP=2 with --batch-size 3: rank 0 runs 4 documents in two batches,
# rank 1 three documents and one fully masked batch); 47 is odd, so SP pads the width
LENGTHS = [5, 60, 16, 29, 8, 41, 23]
SEQ_LENGTH = 47
LAYOUTS = {
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2": [],
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env():
    # the repo's own package, whatever an installed copy says
    env = run_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _eval_jump(launcher, argv, out_json):
    """eval_jump under ``launcher``; one process (forked: tests/forked_trainer.py) for None.
    The CSV goes beside the JSON (``r.csv``)."""
    out_csv = os.path.join(os.path.dirname(out_json), "r.csv")
    cmd = ["tools/eval_jump.py", *map(str, argv), "--json", str(out_json), "--csv", out_csv,
           "--no-progress"]
    if launcher is None:
        proc = forked_trainer.run_tool(cmd[0], cmd[1:], _env(), timeout=300)
    else:
        cmd = [*launcher, *cmd]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    with open(out_json) as f:
        return proc.stdout, json.load(f)


def expected_tokens(text_file):
    with open(text_file) as f:  # ByteTokenizer: one token per ASCII byte, nothing added
        return sum(min(len(line.rstrip("\n")), SEQ_LENGTH) for line in f if line.strip())


@pytest.fixture(scope="module")
def uneven_text(tmp_path_factory):
    words = ["jump", "layer", "norm", "token", "state", "model", "the", "of", "a", "residual"]
    docs = []
    for i, n in enumerate(LENGTHS):
        text = ""
        while len(text) < n:
            text += words[(7 * i + len(text)) % len(words)] + " "
        docs.append(text[:n].strip())
    path = tmp_path_factory.mktemp("uneven") / "eval.txt"
    path.write_text("\n".join(docs) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def single_process(trained_checkpoints, uneven_text, tmp_path_factory):
    args = ["--load", trained_checkpoints["tp1"], "--text-file", uneven_text,
            "--seq-length", SEQ_LENGTH, "--batch-size", 3]
    out_json = tmp_path_factory.mktemp("single") / "r.json"
    _, report = _eval_jump(None, args, out_json)
    return args, report, out_json


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_torchrun_layout_matches_single_process(layout, single_process, tmp_path):
    args, ref, _ = single_process
    stdout, report = _eval_jump(TORCHRUN, args + LAYOUTS[layout], tmp_path / "r.json")
    assert report["tokens"] == ref["tokens"] == expected_tokens(args[3])
    worst = max(abs(a - b) / abs(b) for a, b in zip(report["displacement"], ref["displacement"]))
    print(f"{layout}: largest relative difference of Psi_l vs one process {worst:.2e}")
    assert report["displacement"] == pytest.approx(ref["displacement"], rel=1e-6)
    assert report["documents"] == len(LENGTHS) and report["model"] == ref["model"]
    parallel = report["parallel"]
    tp, pp = (2, 1) if layout.startswith("tp") else (1, 2) if layout == "pp2" else (1, 1)
    assert (parallel["tensor_model_parallel_size"], parallel["pipeline_model_parallel_size"],
            parallel["data_parallel_size"]) == (tp, pp, 2 // (tp * pp))
    assert parallel["sequence_parallel"] == (layout == "tp2_sp")
    assert stdout.count("model: ") == 1  # rank 0 alone prints the table


def _csv_rows(out_json):
    with open(os.path.join(os.path.dirname(out_json), "r.csv"), newline="") as f:
        return list(csv.DictReader(f))


def test_context_parallel_matches_single_process(single_process, tmp_path):
    """CP2: each rank measures its two of four chunks of every document (widths padded to a
    multiple of 4); the JSON and the CSV equal one process's but for the layout."""
    args, ref, _ = single_process
    stdout, report = _eval_jump(TORCHRUN, args + ["--context-parallel-size", 2],
                                tmp_path / "r.json")
    assert report["tokens"] == ref["tokens"] == expected_tokens(args[3])  # once, no padding
    worst = max(abs(a - b) / abs(b) for a, b in zip(report["displacement"], ref["displacement"]))
    print(f"cp2: Psi_l {report['displacement']}; largest relative difference vs one process "
          f"{worst:.2e}")
    assert report["displacement"] == pytest.approx(ref["displacement"], rel=1e-6)
    assert report["jump_rate_by_layer"] == pytest.approx(ref["jump_rate_by_layer"], rel=1e-6)
    assert report["jump_rate"] == pytest.approx(ref["jump_rate"], rel=1e-6)
    assert report.pop("parallel") == {
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
        "context_parallel_size": 2, "data_parallel_size": 1, "sequence_parallel": False}
    numbers = ("displacement", "jump_rate", "jump_rate_by_layer", "parallel")
    assert {k: v for k, v in report.items() if k not in numbers} == {
        k: v for k, v in ref.items() if k not in numbers}
    rows, ref_rows = _csv_rows(tmp_path / "r.json"), _csv_rows(single_process[2])
    assert [(r["model"], r["layer"]) for r in rows] == [(r["model"], r["layer"]) for r in ref_rows]
    for row, ref_row in zip(rows, ref_rows):
        for key in ("displacement", "jump_rate"):
            if ref_row[key]:
                assert float(row[key]) == pytest.approx(float(ref_row[key]), rel=1e-6)
            else:
                assert row[key] == ref_row[key]
    assert stdout.count("model: ") == 1  # rank 0 alone prints the table


def test_context_parallel_layout_refusals(trained_checkpoints, uneven_text, capsys):
    # one process cannot hold CP2; checked before any model is built
    code = main(["--load", trained_checkpoints["tp1"], "--text-file", uneven_text,
                 "--context-parallel-size", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--context-parallel-size 2 needs 2 processes" in err
    code = main(["--reports", "x.json", "--context-parallel-size", "2"])
    assert code == 2 and "--context-parallel-size only applies to --load" in capsys.readouterr().err
    with pytest.raises(InputError, match=r"3 processes do not split into .* x "
                                         r"--context-parallel-size 2; .* multiple of 2$"):
        check_layout(ParallelConfig(context_parallel_size=2), 3)


def test_layout_flags_need_torchrun_and_load(trained_checkpoints, uneven_text, capsys):
    # one process cannot hold TP2; checked before any model is built
    code = main(["--load", trained_checkpoints["tp1"], "--text-file", uneven_text,
                 "--tensor-model-parallel-size", "2"])
    assert code == 2 and "needs 2 processes" in capsys.readouterr().err
    # Megatron-LM's rule: sequence parallelism is off at TP1, said in one line; same numbers
    code = main(["--load", trained_checkpoints["tp1"], "--text-file", uneven_text])
    assert code == 0
    plain = capsys.readouterr().out
    code = main(["--load", trained_checkpoints["tp1"], "--text-file", uneven_text,
                 "--sequence-parallel"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out == plain
    assert "--sequence-parallel: turned off at --tensor-model-parallel-size 1" in captured.err
    code = main(["--reports", "x.json", "--pipeline-model-parallel-size", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "--pipeline-model-parallel-size only applies to --load" in err


def test_layout_checks_name_the_fix():
    with pytest.raises(InputError, match="multiple of 4"):
        check_layout(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                     6)
    model = SimpleNamespace(num_attention_heads=4, query_groups=2, ffn_size=64, num_layers=4)
    with pytest.raises(InputError,
                       match=r"513 rows .* not divisible by --tensor-model-parallel-size 2"):
        check_model_split("ckpt", model, 513, ParallelConfig(tensor_model_parallel_size=2))
    with pytest.raises(InputError, match="2 query groups"):
        check_model_split("ckpt", model, 512, ParallelConfig(tensor_model_parallel_size=4))
    with pytest.raises(InputError, match="4 layers .* --pipeline-model-parallel-size 3"):
        check_model_split("ckpt", model, 512, ParallelConfig(pipeline_model_parallel_size=3))
