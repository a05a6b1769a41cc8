"""Resume, signals, torn checkpoints, resharding on load, NaN control and config errors."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from trainer_runs import (
    REPO,
    base_args,
    rank_pids,
    read_metrics,
    read_until,
    run_env,
    start_trainer,
    step_of,
    train,
)

from megatron_jreg.checkpoint.dist_checkpoint import COMPLETE, TRACKER, iteration_dir


@pytest.mark.parametrize("nproc,extra", [
    (1, {}),
    (2, {"use_distributed_optimizer": True}),  # DP2: exercises the 0.16.1 dist-opt fixes
    (1, {"bf16": True, "use_distributed_optimizer": True}),  # fp32 main params of bf16 weights
], ids=["single", "dp2_distributed_optimizer", "bf16_distributed_optimizer"])
def test_resume_is_bit_exact(demo_data, tmp_path, nproc, extra):
    common = dict(train_iters=8, save_interval=4, **extra)
    full = tmp_path / "full.jsonl"
    train(base_args(demo_data, metrics_file=full, save=tmp_path / "a", **common), nproc=nproc)
    part = tmp_path / "part.jsonl"
    train(base_args(demo_data, metrics_file=part, save=tmp_path / "b", exit_interval=4, **common),
          nproc=nproc)
    assert open(tmp_path / "b" / TRACKER).read() == "4"
    train(base_args(demo_data, metrics_file=part, save=tmp_path / "b", load=tmp_path / "b",
                    **common),
          nproc=nproc)
    a, b = read_metrics(full), read_metrics(part)
    assert [r["iteration"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b):
        assert y["lm_loss"] == x["lm_loss"], (x["iteration"], x["lm_loss"], y["lm_loss"])
        assert y["psi"] == x["psi"] and y["lr"] == x["lr"]


def test_sigterm_saves_and_exits_cleanly(demo_data, tmp_path):
    argv = base_args(demo_data, train_iters=10000, save=tmp_path / "ckpt", seq_length=32)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_jreg.train"] + argv, cwd=REPO,
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    deadline = time.time() + 300
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iteration") and int(line.split()[1].split("/")[0]) >= 3:
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() < deadline, "".join(lines[-20:])
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, rest[-3000:]
    assert "signal received" in rest
    saved = int(open(tmp_path / "ckpt" / TRACKER).read())
    assert 3 <= saved < 10000
    assert os.path.exists(os.path.join(iteration_dir(str(tmp_path / "ckpt"), saved), COMPLETE))


def test_torn_checkpoint_is_detected_and_earlier_one_loads(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(base_args(demo_data, train_iters=4, save=ckpt, save_interval=2))
    # a crash in the middle of a save leaves a .partial directory and the tracker untouched
    os.makedirs(str(ckpt / "iter_0000006.partial"))
    resumed = train(base_args(demo_data, train_iters=5, lr_decay_iters=4, save=ckpt, load=ckpt))
    assert "iteration 4" in resumed.stdout
    assert "removed 1 unfinished save(s) of earlier runs: iter_0000006.partial" in resumed.stdout
    assert not (ckpt / "iter_0000006.partial").exists()
    # a directory that lost its completion marker is refused with the way out
    os.remove(os.path.join(iteration_dir(str(ckpt), 4), COMPLETE))
    open(ckpt / TRACKER, "w").write("4")
    proc = train(base_args(demo_data, train_iters=6, lr_decay_iters=4, load=ckpt), check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert "incomplete" in err and "--ckpt-step 2" in err
    ok = train(base_args(demo_data, train_iters=3, lr_decay_iters=4, load=ckpt, ckpt_step=2))
    assert "loaded checkpoint" in ok.stdout and "iteration 2" in ok.stdout


def test_saving_an_iteration_again_replaces_it_whole(demo_data, tmp_path):
    """Resumed from an earlier checkpoint (--overwrite-checkpoints: without it the later
    iterations are not replaced, test_save_lineage.py), a run reaches a saved iteration
    again: the new save replaces the old one and leaves no side directories; it loads."""
    ckpt = tmp_path / "ckpt"
    first = tmp_path / "first.jsonl"
    train(base_args(demo_data, train_iters=4, save=ckpt, save_interval=2, metrics_file=first))
    again = tmp_path / "again.jsonl"
    train(base_args(demo_data, train_iters=4, save=ckpt, save_interval=2, load=ckpt, ckpt_step=2,
                    metrics_file=again, overwrite_checkpoints=True))
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000004", TRACKER]
    assert open(ckpt / TRACKER).read() == "4"
    assert read_metrics(again)[-1]["lm_loss"] == read_metrics(first)[-1]["lm_loss"]
    resumed = train(base_args(demo_data, train_iters=5, lr_decay_iters=4, load=ckpt))
    assert "iteration 4" in resumed.stdout


def test_corrupt_shard_gives_clear_error(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(base_args(demo_data, train_iters=2, save=ckpt))
    path = iteration_dir(str(ckpt), 2)
    shards = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert shards
    with open(os.path.join(path, shards[0]), "r+b") as f:
        f.truncate(100)
    proc = train(base_args(demo_data, train_iters=3, lr_decay_iters=2, load=ckpt), check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert f"{os.path.join(path, shards[0])} has 100 bytes, the manifest" in err
    assert "--ckpt-step" in err
    # without the manifest check, dist-checkpointing's own failure is named the same way
    proc = train(base_args(demo_data, train_iters=3, lr_decay_iters=2, load=ckpt,
                           **{"no-verify-checkpoint": True}), check=False)
    assert proc.returncode == 2
    assert re.search(r"error: cannot read (checkpoint file|entry \S+ of checkpoint file) ",
                     proc.stderr) and "--ckpt-step" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def reshard_source(demo_data, tmp_path_factory):
    """A single-rank checkpoint (vocab 512), the first step of a single-rank run loading it,
    and the first step of a fresh run with the same seed: shared by the layouts below."""
    root = tmp_path_factory.mktemp("reshard")
    ckpt = root / "ckpt"
    train(base_args(demo_data, train_iters=4, save=ckpt, vocab_size=512))
    steps = {}
    for name, extra in (("tp1", {"load": ckpt, "no_load_optim": True}), ("fresh", {})):
        metrics = root / f"{name}.jsonl"
        train(base_args(demo_data, train_iters=1, vocab_size=512, metrics_file=metrics, seed=99,
                        **extra))
        steps[name] = read_metrics(metrics)[0]
    return ckpt, steps


@pytest.mark.parametrize("layout",
                         [{"tensor_model_parallel_size": 2}, {"pipeline_model_parallel_size": 2}],
                         ids=["tp2", "pp2"])
def test_checkpoint_reshards_on_load(demo_data, reshard_source, tmp_path, layout):
    ckpt, steps = reshard_source
    metrics = tmp_path / "other.jsonl"
    train(base_args(demo_data, train_iters=1, load=ckpt, no_load_optim=True, vocab_size=512,
                    metrics_file=metrics, seed=99, **layout), nproc=2)
    other, tp1 = read_metrics(metrics)[0], steps["tp1"]
    # the first step's loss is measured before the update: it reflects the loaded weights
    assert other["lm_loss"] == pytest.approx(tp1["lm_loss"], rel=1e-5)
    assert other["psi"] == pytest.approx(tp1["psi"], rel=1e-4)
    assert abs(steps["fresh"]["lm_loss"] - tp1["lm_loss"]) > 1e-3


def test_nan_loss_stops_with_iteration_or_skips(demo_data, tmp_path):
    proc = train(base_args(demo_data, train_iters=3, init_method_std=1e30), check=False)
    assert proc.returncode == 3
    assert re.search(r"^error: iteration 1: (LM loss|JREG penalty|gradient norm) is (nan|inf)",
                     proc.stderr, re.M), proc.stderr[-2000:]
    skipped = train(base_args(demo_data, train_iters=2, init_method_std=1e30, exit_on_nan=None,
                              **{"no-exit-on-nan": True}))
    assert "step skipped" in skipped.stdout


@pytest.mark.parametrize("overrides,message", [
    ({"num_attention_heads": 3}, "not divisible by --num-attention-heads"),
    ({"pipeline_model_parallel_size": 3},
     "--num-layers 4 is not divisible by --pipeline-model-parallel-size 3"),
    ({"global_batch_size": 6}, "--global-batch-size 6 is not divisible by --micro-batch-size 4"),
    ({"vocab_size": 100}, "smaller than the tokenizer's"),
    ({"data_path": None}, "--data-path is missing"),
    ({"data_path": "/nonexistent/data_text_document"}, "no /nonexistent/data_text_document.bin"),
    ({"lr_decay_style": "exp"}, "--lr-decay-style 'exp'"),
    ({"jreg_weighting": "linear"}, "--jreg-weighting 'linear'"),
    ({"lr_warmup_iters": 6}, "--lr-warmup-iters 6 must be below the decay length 6"),
])
def test_config_errors_fail_before_work(demo_data, overrides, message, capsys):
    from megatron_jreg.train import main

    try:
        code = main(base_args(demo_data, **overrides))
    except SystemExit as exc:  # argparse-level errors
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err, err


def test_sigint_saves_and_exits_cleanly(demo_data, tmp_path):
    proc = start_trainer(base_args(demo_data, train_iters=10000, save=tmp_path / "ckpt",
                                   seq_length=32))
    lines = []
    read_until(proc, lambda l: step_of(l) >= 2, lines, f"step {2}")
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, rest[-3000:]
    assert "signal received: saving at iteration" in rest
    saved = int(open(tmp_path / "ckpt" / TRACKER).read())
    assert os.path.exists(os.path.join(iteration_dir(str(tmp_path / "ckpt"), saved), COMPLETE))


def test_without_the_exit_signal_handler_sigterm_kills_without_saving(demo_data, tmp_path):
    proc = start_trainer(base_args(demo_data, train_iters=10000, save=tmp_path / "ckpt",
                                   seq_length=32,
                            save_interval=100000, no_exit_signal_handler=True))
    lines = []
    read_until(proc, lambda l: step_of(l) >= 2, lines, f"step {2}")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGTERM, rest[-3000:]  # the default action: killed
    assert "signal received" not in rest
    assert not (tmp_path / "ckpt" / TRACKER).exists()


def test_a_signal_on_one_of_two_ranks_stops_both_at_one_saved_step(demo_data, tmp_path):
    """Slurm may signal one task: the ranks agree at the end of the step, both save the same
    iteration and exit 0 (none hangs in a collective the other left)."""
    ckpt = tmp_path / "ckpt"
    proc = start_trainer(base_args(demo_data, train_iters=10000, save=ckpt, seq_length=32,
                            save_interval=100000), nproc=2)
    lines = []
    read_until(proc, lambda l: step_of(l) >= 2, lines, f"step {2}")
    pids = rank_pids(proc.pid)
    assert set(pids) == {0, 1}, pids
    os.kill(pids[1], signal.SIGTERM)  # rank 1 only: rank 0 prints, rank 1 got the signal
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, rest[-3000:]
    saved = int(open(ckpt / TRACKER).read())
    assert "signal received: saving at iteration %d" % saved in rest
    assert os.path.exists(os.path.join(iteration_dir(str(ckpt), saved), COMPLETE))


def test_interleaved_pipeline_checkpoints_resume_exactly_and_reshard(demo_data, tmp_path):
    """PP2 with two model chunks per rank (VPP): a run stopped at 4 and resumed equals the
    uninterrupted run; its checkpoint loads at TP1 PP1 (one process) with the same weights
    as at VPP."""
    vpp = {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1}
    common = dict(train_iters=6, save_interval=4, vocab_size=512, **vpp)
    full, part = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    train(base_args(demo_data, metrics_file=full, save=tmp_path / "a", **common), nproc=2)
    ckpt = tmp_path / "b"
    train(base_args(demo_data, metrics_file=part, save=ckpt, exit_interval=4, **common), nproc=2)
    assert open(ckpt / TRACKER).read() == "4"
    train(base_args(demo_data, metrics_file=part, save=ckpt, load=ckpt, **common), nproc=2)
    a, b = read_metrics(full), read_metrics(part)
    assert [r["iteration"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert (y["lm_loss"], y["psi"], y["lr"]) == (x["lm_loss"], x["psi"],
                                                     x["lr"]), x["iteration"]
    # the VPP checkpoint's weights at TP1 PP1 and back at VPP: the same first loss and psi
    runs = {}
    for name, nproc, extra in (("tp1", 1, {}), ("vpp", 2, vpp)):
        metrics = tmp_path / f"load_{name}.jsonl"
        train(base_args(demo_data, train_iters=1, load=tmp_path / "a", no_load_optim=True,
                        vocab_size=512, metrics_file=metrics, seed=99, **extra), nproc=nproc)
        runs[name] = read_metrics(metrics)[0]
    assert runs["tp1"]["lm_loss"] == pytest.approx(runs["vpp"]["lm_loss"], rel=1e-5)
    assert runs["tp1"]["psi"] == pytest.approx(runs["vpp"]["psi"], rel=1e-4)
    assert abs(runs["tp1"]["lm_loss"] - a[0]["lm_loss"]) > 1e-3  # trained weights were loaded
