"""The trainer checks every path it writes before any work: missing parents are made,
an unwritable one is one line naming the flag, exit 2, before the model is built."""

import os

import pytest
from trainer_runs import base_args, read_metrics, train

from unwritable import unwritable_dir


def test_missing_output_directories_are_made(demo_data, tmp_path):
    new = tmp_path / "runs" / "x"
    train(base_args(demo_data, train_iters=2, metrics_file=new / "metrics.jsonl",
                    tensorboard_dir=new / "tb", save=new / "ckpt",
                    data_cache_path=tmp_path / "cache" / "idx"), nproc=2)
    assert [r["iteration"] for r in read_metrics(new / "metrics.jsonl")] == [1, 2]
    assert os.listdir(new / "tb") and (new / "ckpt" / "iter_0000002").is_dir()
    assert os.listdir(tmp_path / "cache" / "idx")  # megatron-core's sample indices


@pytest.mark.parametrize("flag, sub", [("metrics-file", "missing/m.jsonl"),
                                       ("metrics-file", "m.jsonl"),
                                       ("tensorboard-dir", "tb"),
                                       ("save", "ckpt"),
                                       ("data-cache-path", "cache")])
def test_unwritable_output_stops_every_rank_before_any_work(demo_data, tmp_path, flag, sub):
    path = f"{unwritable_dir(tmp_path)}/{sub}"
    proc = train(base_args(demo_data, train_iters=2, **{flag: path}), nproc=2, check=False)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert lines and all(line == lines[0] for line in lines), proc.stderr[-3000:]
    assert f"--{flag} {path}" in lines[0]
    assert "transformer implementation" not in proc.stdout and "lm loss" not in proc.stdout


def test_unwritable_output_in_one_process_is_exit_2_and_one_line(demo_data, tmp_path):
    path = f"{unwritable_dir(tmp_path)}/missing/m.jsonl"
    proc = train(base_args(demo_data, train_iters=2, metrics_file=path), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: --metrics-file {path}: cannot create directory "
                           f"{os.path.dirname(path)} ("), line
    assert proc.stdout == ""
