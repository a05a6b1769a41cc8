"""The suite's forked single-rank trainer runs and tool runs (tests/forked_trainer.py) are
the runs a fresh ``python -m megatron_jreg.train`` or ``python tools/X.py`` makes: same
exit code, output, metrics and files."""

import json
import os
import re
import subprocess
import sys

import pytest
from trainer_runs import REPO, base_args, run_env

import forked_trainer

TIMING = re.compile(r"(tokens/s|in) [\d,.]+s?|mem [\d.]+ GiB|\d+\.\ds")
RATE = re.compile(r" in [\d.]+ s \([^)]*\)")  # preprocess_data's time and throughput


def fresh(argv, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "megatron_jreg.train", *argv], cwd=cwd,
                          env=env or run_env(), capture_output=True, text=True, timeout=300)


def without_timings(text):
    return [TIMING.sub("", line) for line in text.splitlines()]


def test_a_forked_run_is_the_fresh_interpreters_run(demo_data, tmp_path):
    runs = {}
    for how in ("fresh", "forked"):
        out = tmp_path / how
        argv = base_args(demo_data, train_iters=4, save=out / "ckpt", save_interval=4,
                         metrics_file=out / "metrics.jsonl")
        proc = fresh(argv) if how == "fresh" else forked_trainer.run(argv, REPO, run_env(), 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        for row in rows:  # wall-clock fields, and the id each run draws
            for key in [k for k in row if "time" in k or "per_s" in k or k.startswith("mem")
                        or k == "run_id"]:
                row.pop(key)
        runs[how] = (without_timings(proc.stdout.replace(str(out), "OUT")), rows)
    assert runs["forked"] == runs["fresh"]
    assert any("lm loss" in line for line in runs["forked"][0])


def test_errors_exit_codes_and_working_directory_are_the_childs(demo_data, tmp_path):
    """A refused flag (exit 2, one line on stderr) as a fresh process gives it, and a
    relative --data-path read from the run's working directory."""
    argv = base_args("missing/prefix")
    forked = forked_trainer.run(argv, tmp_path, run_env(), 300)
    plain = fresh(argv, cwd=tmp_path)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        plain.returncode, plain.stdout, plain.stderr)
    assert forked.returncode == 2 and len(forked.stderr.splitlines()) == 1, forked.stderr
    (tmp_path / "data").mkdir()
    for ext in (".bin", ".idx"):
        os.symlink(demo_data + ext, tmp_path / "data" / ("demo" + ext))
    proc = forked_trainer.run(base_args("data/demo", train_iters=1), tmp_path, run_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "data" / "index-cache").is_dir()  # beside the data, in the run's cwd


def test_a_run_past_its_timeout_is_killed(demo_data):
    with pytest.raises(subprocess.TimeoutExpired):
        forked_trainer.run(base_args(demo_data, train_iters=100000), REPO, run_env(), 3)
    # the server is still usable after the kill
    assert forked_trainer.run(["--help"], REPO, run_env(), 60).returncode == 0


def test_a_forked_tool_run_is_the_fresh_interpreters_run(tmp_path):
    """tools/make_demo_corpus.py, tools/preprocess_data.py (two worker processes of its own),
    an existing output refused and an argparse error, forked and in a fresh interpreter:
    same exit codes, stdout, stderr and files."""
    runs = {}
    for how in ("fresh", "forked"):
        out = tmp_path / how
        out.mkdir()
        preprocess = ["--input", out / "c.jsonl", "--output-prefix", out / "d",
                      "--tokenizer-type", "ByteTokenizer", "--append-eod"]
        steps = [("tools/make_demo_corpus.py", ["--output", out / "c.jsonl", "--max-docs", "40"]),
                 ("tools/preprocess_data.py", preprocess + ["--workers", "2"]),
                 ("tools/preprocess_data.py", preprocess),  # the output exists: exit 2
                 ("tools/make_demo_corpus.py", ["--max-docs", "40"])]  # no --output: exit 2
        procs = []
        for script, argv in steps:
            if how == "fresh":
                proc = subprocess.run([sys.executable, script, *map(str, argv)], cwd=REPO,
                                      env=run_env(), capture_output=True, text=True, timeout=300)
            else:
                proc = forked_trainer.run_tool(script, argv, run_env(), timeout=300)
            stdout = RATE.sub("", proc.stdout.replace(str(out), "OUT")).splitlines()
            procs.append((proc.returncode, stdout, proc.stderr.replace(str(out), "OUT")))
        files = {name: (out / name).read_bytes() for name in sorted(os.listdir(out))}
        runs[how] = (procs, files)
    assert runs["forked"] == runs["fresh"]
    procs, files = runs["forked"]
    assert [code for code, _, _ in procs] == [0, 0, 2, 2]
    assert sorted(files) == ["c.jsonl", "d_text_document.bin", "d_text_document.idx"]
    # the byte tokenizer: one token per UTF-8 byte of each document, and its EOD
    texts = [json.loads(line)["text"] for line in files["c.jsonl"].decode().splitlines()]
    done = [line for line in procs[1][1] if line.startswith("done:")]
    assert len(texts) == 40 and done, procs[1]
    assert f"40 documents, {sum(len(t.encode()) + 1 for t in texts)} tokens" in done[0]
    assert procs[3][2].startswith("make_demo_corpus.py: error: "), procs[3][2]  # its argv[0]
