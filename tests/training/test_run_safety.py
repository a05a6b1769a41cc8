"""What a run must never do: save or log NaN as a number, share a checkpoint directory with
another run, replace checkpoints it did not resume from, resume a schedule other than the
one asked for, or load a checkpoint whose bytes changed."""

import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
from trainer_runs import (
    REPO,
    base_args,
    read_metrics,
    read_until,
    run_env,
    start_trainer,
    step_of,
    train,
)

from megatron_jreg.checkpoint.dist_checkpoint import TRACKER, iteration_dir


def strict_json_lines(path):
    def refuse(name):
        raise ValueError(f"bare {name} in {path}")

    return [json.loads(line, parse_constant=refuse) for line in open(path)]


def model_tensors(path, scratch):
    """The model's tensors of one iteration directory (no process group needed)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(scratch, os.path.basename(path) + ".pt")
    dcp_to_torch_save(path, out)
    state = torch.load(out, weights_only=False)
    os.remove(out)
    return {k: v for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point() and not k.startswith("optimizer")}


def saved_tensors_finite(ckpt, scratch):
    """{iteration: every model tensor is finite} for each whole save under ``ckpt``."""
    result = {}
    for name in sorted(os.listdir(ckpt)):
        if name.startswith("iter_") and name[5:].isdigit():
            tensors = model_tensors(os.path.join(ckpt, name), scratch)
            assert tensors
            result[int(name[5:])] = all(bool(torch.isfinite(t).all()) for t in tensors.values())
    return result


# ---- non-finite steps ------------------------------------------------------------------

def test_divergence_stops_before_any_nan_save(demo_data, tmp_path):
    """--lr 1e6 diverges at step 2: the run exits 3 naming it, and nothing after the last
    finite step is saved (before: iteration 3 was saved with NaN weights and marked latest)."""
    ckpt = tmp_path / "ckpt"
    proc = train(base_args(demo_data, lr=1e6, train_iters=6, save=ckpt, save_interval=1),
                 check=False)
    assert proc.returncode == 3, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    failed = int(re.search(r"^error: iteration (\d+): ", err).group(1))
    assert "no update was applied and nothing saved" in err
    saved = saved_tensors_finite(ckpt, tmp_path)
    assert saved and all(saved.values()) and max(saved) < failed, (saved, err)
    assert int(open(ckpt / TRACKER).read()) == max(saved)


def test_skipped_steps_leave_weights_finite_and_log_null(demo_data, tmp_path):
    """--no-exit-on-nan: non-finite steps are skipped (no update), counted, logged as null in
    strict JSON, and every save holds finite weights."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = train(base_args(demo_data, lr=1e6, train_iters=5, save=ckpt, save_interval=1,
                           metrics_file=metrics, **{"no-exit-on-nan": True}))
    records = strict_json_lines(metrics)
    skipped = [r for r in records if r["jreg_penalty"] is None or r.get("grad_norm") is None]
    assert skipped, records
    for r in records:  # a non-finite Psi gives no jump rate (never 0); a finite one gives one
        non_finite = r["psi"] is None or any(p is None for p in r["psi"])
        assert (r["zeta_L"] is None) == non_finite, r
    assert re.search(r"\((\d+) skipped: non-finite", proc.stdout)
    saved = saved_tensors_finite(ckpt, tmp_path)
    assert sorted(saved) == [1, 2, 3, 4, 5] and all(saved.values()), saved
    # skipped steps leave the weights alone: every save after the first skip is identical
    first_skip = skipped[0]["iteration"]
    a = model_tensors(iteration_dir(str(ckpt), first_skip - 1), tmp_path)
    b = model_tensors(iteration_dir(str(ckpt), 5), tmp_path)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_save_refuses_nonfinite_parameters(tmp_path):
    from megatron_jreg.checkpoint.dist_checkpoint import CheckpointError, save_checkpoint

    model = torch.nn.Linear(3, 3)
    with torch.no_grad():
        model.weight[1, 2] = float("nan")
    with pytest.raises(CheckpointError,
                       match=r"refusing to save iteration 7: non-finite parameters \(weight\)"):
        save_checkpoint(str(tmp_path / "ckpt"), 7, [model], None, None, "", {})
    assert not (tmp_path / "ckpt").exists()


def test_nonfinite_parameters_names_the_first_three_in_order():
    from megatron_jreg.checkpoint.dist_checkpoint import nonfinite_parameters

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(5)))
    with torch.no_grad():
        for i, value in ((1, float("inf")), (2, float("nan")), (3, float("-inf")),
                         (4, float("nan"))):
            model[i].weight[0, 1] = value
        model[0].bias[1] = float("nan")
    assert nonfinite_parameters([model]) == ["0.bias", "1.weight", "2.weight"]
    assert nonfinite_parameters([torch.nn.Linear(2, 2)]) == []
    assert nonfinite_parameters([model[0], model[3]]) == ["chunk 0: bias", "chunk 1: weight"]


# ---- schedule on resume ------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_steps(demo_data, tmp_path_factory):
    """A run of 4 steps at --lr 3e-3 (cosine to 0 over 8), saved at 4."""
    ckpt = tmp_path_factory.mktemp("sched") / "ckpt"
    train(base_args(demo_data, train_iters=4, lr_decay_iters=8, lr_decay_style="cosine", save=ckpt))
    return ckpt


def _resume(demo_data, four_steps, tmp_path, **flags):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(four_steps, ckpt)
    metrics = tmp_path / "m.jsonl"
    proc = train(base_args(demo_data, train_iters=5, lr_decay_iters=8, lr_decay_style="cosine",
                           save=ckpt, load=ckpt, metrics_file=metrics, **flags), check=False)
    return proc, metrics, ckpt


def test_changed_schedule_on_resume_is_an_error_naming_both_values(demo_data, four_steps, tmp_path):
    proc, _, _ = _resume(demo_data, four_steps, tmp_path, lr=1e-3, min_lr=1e-4)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert ("--lr 0.001 here, --lr 0.003 in the checkpoint" in err
            and "--min-lr 0.0001 here, --min-lr 0.0 in the checkpoint" in err)
    assert "pass --lr 0.003 --min-lr 0.0 or --use-checkpoint-opt-param-scheduler" in err
    assert "--override-opt-param-scheduler" in err


def test_other_adam_settings_on_resume_are_an_error_naming_the_checkpoints(demo_data, four_steps,
                                                                        tmp_path):
    """The optimizer's loaded state brings back the Adam settings it was trained with: a
    resume under other --adam-beta2/--adam-eps (e.g. a default that changed) is refused in one
    line naming the flags that continue it, not trained with the checkpoint's while the run
    records its own; --override-opt-param-scheduler takes the flags."""
    proc, _, _ = _resume(demo_data, four_steps, tmp_path, adam_beta2=0.95, adam_eps=1e-6)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert ("--adam-beta2 0.95 here, --adam-beta2 0.999 in the checkpoint; --adam-eps 1e-06 "
            "here, --adam-eps 1e-08 in the checkpoint): to continue it pass --adam-beta2 0.999 "
            "--adam-eps 1e-08; --override-opt-param-scheduler takes this run's values") in err
    proc, metrics, _ = _resume(demo_data, four_steps, tmp_path / "override", adam_beta2=0.95,
                               override_opt_param_scheduler=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["iteration"] for r in read_metrics(metrics)] == [5]


def test_a_global_batch_left_out_that_differs_from_the_checkpoints_is_named(demo_data, four_steps,
                                                                           tmp_path):
    """Saved at --global-batch-size 8; resumed without it, the batch is --micro-batch-size 4
    x one data-parallel rank (Megatron-LM's rule): a line names the flag that continues the
    run as it was, before the schedule (a decay of 8 steps of 8, now of 4) is refused."""
    proc, _, _ = _resume(demo_data, four_steps, tmp_path, global_batch_size=None)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert ("--global-batch-size left out: 4 (--micro-batch-size 4 x the data-parallel size), "
            "the checkpoint's run had 8; pass --global-batch-size 8 to continue it as it was"
            ) in proc.stdout
    assert "--lr-decay-iters 8 here, --lr-decay-iters 16 in the checkpoint" in proc.stderr


@pytest.mark.parametrize("spelling",
                         ["override-opt-param-scheduler", "override-opt_param-scheduler"])
def test_override_takes_the_flags(demo_data, four_steps, tmp_path, spelling):
    proc, metrics, _ = _resume(demo_data, four_steps, tmp_path, lr=1e-3, **{spelling: True})
    assert proc.returncode == 0, proc.stderr[-2000:]
    # step 5 of a cosine from 1e-3 to 0 over 8 steps: lr after the 5th scheduler step
    import math

    expected = 1e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 8))
    assert read_metrics(metrics)[0]["lr"] == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("spelling", ["use-checkpoint-opt-param-scheduler",
                                      "use-checkpoint-opt_param-scheduler"])
def test_use_checkpoint_keeps_its_schedule_and_records_it(demo_data, four_steps, tmp_path,
                                                          spelling):
    import math

    import yaml

    proc, metrics, ckpt = _resume(demo_data, four_steps, tmp_path, lr=1e-3, **{spelling: True})
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = 3e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 8))
    assert read_metrics(metrics)[0]["lr"] == pytest.approx(expected, rel=1e-9)
    saved = yaml.safe_load(open(os.path.join(iteration_dir(str(ckpt), 5), "run_config.yaml")))
    assert saved["optim"]["lr"] == 3e-3  # what ran, not the ignored flag


def test_both_schedule_flags_contradict(demo_data):
    proc = train(base_args(demo_data, **{"override-opt-param-scheduler": True,
                                         "use-checkpoint-opt-param-scheduler": True}), check=False)
    assert proc.returncode == 2 and "contradict" in proc.stderr


# ---- one writer per directory; no silent overwrite; tracker recovery -----------------------

def test_second_run_on_the_same_save_is_refused(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    argv = base_args(demo_data, train_iters=100000, save=ckpt, save_interval=100000, seq_length=32)
    first = start_trainer(argv)
    try:
        read_until(first, lambda line: step_of(line) >= 1, [], "step 1")
        second = train(argv, check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        err = second.stderr.strip().splitlines()[-1]
        assert f"is in use by pid {first.pid} on host {socket.gethostname()}" in err, err
        assert "iteration" not in second.stdout  # refused before any step
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    assert first.returncode == 0
    assert not (ckpt / "jreg_writer.lock").exists()  # released at exit


def test_stale_lock_of_a_dead_process_is_taken_over(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    os.makedirs(ckpt)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with open(ckpt / "jreg_writer.lock", "w") as f:
        json.dump({"host": socket.gethostname(), "pid": dead.pid, "start_time": "then",
                   "run_id": "x"}, f)
    # a kill mid-save also left a temporary directory of that run
    os.makedirs(ckpt / "iter_0000002.partial-x")
    proc = train(base_args(demo_data, train_iters=2, save=ckpt))
    assert (f"took over the lock of pid {dead.pid} on host {socket.gethostname()}, started then: "
            "its process is no longer running") in proc.stdout
    assert "removed 1 unfinished save(s) of earlier runs: iter_0000002.partial-x" in proc.stdout
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", TRACKER]


def test_fresh_run_into_checkpoints_is_refused(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    train(base_args(demo_data, train_iters=2, save=ckpt))
    before = open(os.path.join(iteration_dir(str(ckpt), 2), "__0_0.distcp"), "rb").read()
    proc = train(base_args(demo_data, train_iters=2, save=ckpt, seed=7), check=False)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert f"--save {ckpt} already holds checkpoints" in err and "--overwrite-checkpoints" in err
    assert "iteration" not in proc.stdout
    assert open(os.path.join(iteration_dir(str(ckpt), 2), "__0_0.distcp"), "rb").read() == before
    train(base_args(demo_data, train_iters=2, save=ckpt, seed=7, overwrite_checkpoints=True))
    assert open(os.path.join(iteration_dir(str(ckpt), 2), "__0_0.distcp"), "rb").read() != before


def test_kill_between_rename_and_tracker_resumes_from_newest(demo_data, tmp_path):
    """The tracker left as .tmp (or gone): the launch scripts still pass --load, and the
    trainer resumes from the newest whole iteration with a printed line."""
    ckpt = tmp_path / "ckpt"
    train(base_args(demo_data, train_iters=4, save=ckpt, save_interval=2))
    os.replace(ckpt / TRACKER, ckpt / (TRACKER + ".tmp"))
    load = subprocess.run(["bash", "-c", f"source examples/launch_common.sh; load_args {ckpt}"],
                          cwd=REPO, capture_output=True, text=True)
    assert load.stdout.split() == ["--load", str(ckpt)], load.stderr
    proc = train(base_args(demo_data, train_iters=5, lr_decay_iters=4, save=ckpt, load=ckpt,
                           **{"override-opt-param-scheduler": True}))
    assert f"{ckpt}: no {TRACKER}; using the newest whole iteration 4" in proc.stdout
    assert "loaded checkpoint" in proc.stdout and "iteration 4" in proc.stdout
    assert open(ckpt / TRACKER).read() == "5"
    assert not (ckpt / (TRACKER + ".tmp")).exists()


# ---- damaged checkpoints --------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(demo_data, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("damage") / "ckpt"
    train(base_args(demo_data, train_iters=2, lr_decay_iters=4, save=ckpt))
    return ckpt


def _damaged_copy(saved_run, tmp_path):
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run, ckpt)
    return ckpt, iteration_dir(str(ckpt), 2)


def _resume_damaged(demo_data, ckpt, **flags):
    return train(base_args(demo_data, train_iters=3, lr_decay_iters=4, load=ckpt, **flags),
                 check=False)


def test_flipped_bit_is_caught_by_the_manifest(demo_data, saved_run, tmp_path):
    ckpt, path = _damaged_copy(saved_run, tmp_path)
    shard = max((f for f in os.listdir(path) if f.endswith(".distcp")),
                key=lambda f: os.path.getsize(os.path.join(path, f)))
    with open(os.path.join(path, shard), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(path, shard)) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    proc = _resume_damaged(demo_data, ckpt)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert f"fails its checksum: {os.path.join(path, shard)} changed since it was saved" in err, err
    assert "--ckpt-step" in err and "--no-verify-checkpoint" in err


def test_exponent_flip_is_named_as_damage_not_a_learning_rate(demo_data, saved_run, tmp_path):
    """A weight turned inf by a flipped exponent: without checksums the load names the
    damaged parameter instead of reporting a NaN loss with 'lower --lr'."""
    ckpt, path = _damaged_copy(saved_run, tmp_path)
    target = model_tensors(path,
                           tmp_path)["decoder.final_layernorm.weight"]  # fp32, stored contiguously
    needle = target.contiguous().numpy().tobytes()
    for name in os.listdir(path):
        if name.endswith(".distcp"):
            data = bytearray(open(os.path.join(path, name), "rb").read())
            at = data.find(needle)
            if at >= 0:
                data[at + 3] |= 0x7F  # sign-exponent byte of the first float: inf or NaN
                data[at + 2] |= 0x80
                open(os.path.join(path, name), "wb").write(bytes(data))
                break
    else:
        pytest.fail("final norm weight not found in the shards")
    proc = _resume_damaged(demo_data, ckpt, **{"no-verify-checkpoint": True})
    assert proc.returncode == 2, proc.stdout[-2000:]
    err = proc.stderr.strip().splitlines()[-1]
    assert "holds non-finite weights (decoder.final_layernorm.weight)" in err, err
    assert "lower --lr" not in proc.stderr


def test_earlier_versions_rng_files_load_and_damage_is_named(tmp_path):
    """Checkpoints of earlier versions kept each rank's random state in rng/rank_NNNNN.pt
    (their own key names): it is restored; a damaged or missing file is named with the way on."""
    import json
    import random

    import torch

    from crafted_checkpoints import load_rng_files as _load_rng_files
    from megatron_jreg.errors import CheckpointError

    path = tmp_path / "iter_0000002"
    (path / "rng").mkdir(parents=True)
    (path / "jreg_complete.json").write_text(json.dumps({"iteration": 2, "world_size": 1}))
    random.seed(7)
    torch.manual_seed(7)
    torch.save({"python": random.getstate(), "numpy": __import__("numpy").random.get_state(),
                "torch": torch.get_rng_state(), "tracker": {}, "device": "cpu"},
               path / "rng" / "rank_00000.pt")
    expected = (random.random(), torch.rand(2))
    random.seed(1)
    torch.manual_seed(1)
    _load_rng_files(str(path), 0)
    assert random.random() == expected[0] and torch.equal(torch.rand(2), expected[1])
    rng = path / "rng" / "rank_00000.pt"
    with open(rng, "r+b") as f:
        f.truncate(50)
    with pytest.raises(CheckpointError, match=f"cannot read {rng} .*--no-load-rng"):
        _load_rng_files(str(path), 0)
    rng.unlink()
    with pytest.raises(CheckpointError, match=f"{rng} is missing .*--no-load-rng"):
        _load_rng_files(str(path), 0)


def test_binary_tracker_is_named(demo_data, saved_run, tmp_path):
    ckpt, _ = _damaged_copy(saved_run, tmp_path)
    with open(ckpt / TRACKER, "wb") as f:
        f.write(bytes(range(200, 256)))
    proc = _resume_damaged(demo_data, ckpt)
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()[-1]
    assert str(ckpt / TRACKER) in err and "not an iteration number" in err
    assert "Traceback" not in proc.stderr


def test_checksum_bench_runs_and_reports(tmp_path):
    """bench/checkpoint_checksum.py (small size): one table, a summary, and the manifest it
    times verifies the bytes it wrote."""
    proc = subprocess.run([sys.executable, "bench/checkpoint_checksum.py", "--gb", "0.05",
                           "--shards", "2", "--dir", str(tmp_path)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split("  ")[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith(("write", "manifest", "verify"))}
    assert {"write (fsync)", "manifest (hash all)", "verify, page cache"} <= set(rows), proc.stdout
    assert all(float(r[-1]) > 0 for r in rows.values())
    assert re.search(r"^summary: the manifest adds [\d.]+s to a 0.1 GB save", proc.stdout, re.M)
    assert os.listdir(tmp_path) == []  # cleaned up


def test_wandb_without_wandb_is_refused_before_work(demo_data):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = train(base_args(demo_data, wandb_project="x"), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: --wandb-project needs wandb installed: pip install wandb (or drop --wandb-project)")
    assert "transformer implementation" not in proc.stdout  # nothing was set up
