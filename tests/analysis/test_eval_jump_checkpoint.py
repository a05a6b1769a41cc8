"""eval_jump --load: our trainer's checkpoints, any layout, on one process.

The numbers must be the training-time JREG code's Psi_l on the same tokens, and a TP2 or
PP2 checkpoint must read like the TP1 run of the same seed and data.
"""

import json
import os

import pytest
from checkpoint_runs import ITERS, SEQ, eval_jump

from megatron_jreg.commands.eval_jump import main


@pytest.fixture(scope="module")
def trajectory(trained_checkpoints, checkpoint_text, tmp_path_factory):
    """eval_jump --all-iterations on the tp1 run: (stdout, reports, csv text)."""
    out = tmp_path_factory.mktemp("traj")
    stdout, reports = eval_jump(
        [
            "--load",
            trained_checkpoints["tp1"],
            "--all-iterations",
            "--text-file",
            checkpoint_text[0],
            "--seq-length",
            SEQ,
            "--batch-size",
            3,
            "--csv",
            out / "t.csv",
        ],
        out / "t.json",
    )
    return stdout, reports, (out / "t.csv").read_text()


def test_matches_training_time_jreg(trajectory, checkpoint_reference, trained_checkpoints):
    _, reports, _ = trajectory
    last = reports[-1]
    assert last["iteration"] == ITERS and last["tokens"] == 8 * SEQ
    psi = checkpoint_reference[trained_checkpoints["tp1"]]["psi"]
    assert last["displacement"] == pytest.approx(psi, abs=1e-6)
    assert last["include_final_norm"] is False and last["num_layers"] == 4


def test_trajectory_over_every_iteration(trajectory, trained_checkpoints):
    stdout, reports, csv_text = trajectory
    assert [r["iteration"] for r in reports] == list(range(1, ITERS + 1))
    assert [r["model"] for r in reports] == [f"tp1@{i}" for i in range(1, ITERS + 1)]
    assert all(r["source"] == os.path.abspath(trained_checkpoints["tp1"]) for r in reports)
    assert "iteration" in stdout and "zeta_L-2" in stdout and "Psi_L" in stdout
    assert csv_text.splitlines()[0] == "iteration,model,layer,displacement,jump_rate"
    assert len(csv_text.splitlines()) == 1 + 4 * ITERS
    assert reports[0]["displacement"] != reports[-1]["displacement"]  # the weights moved


def test_tp2_and_pp2_checkpoints_read_like_tp1(
    trained_checkpoints, checkpoint_text, trajectory, tmp_path
):
    _, reports = eval_jump(
        [
            "--load",
            trained_checkpoints["tp2"],
            trained_checkpoints["pp2"],
            "--text-file",
            checkpoint_text[0],
            "--seq-length",
            SEQ,
            "--batch-size",
            8,
        ],
        tmp_path / "par.json",
    )
    ref = trajectory[1][-1]["displacement"]
    assert [r["model"] for r in reports] == [f"tp2@{ITERS}", f"pp2@{ITERS}"]
    for report in reports:
        worst = max(abs(a - b) / abs(b) for a, b in zip(report["displacement"], ref))
        print(f"{report['model']} vs tp1: largest relative difference of Psi_l {worst:.2e}")
        assert report["iteration"] == ITERS and report["tokens"] == 8 * SEQ
        assert report["displacement"] == pytest.approx(ref, rel=1e-4, abs=1e-7), report["model"]


# ---- bad inputs: one line, exit 2, before any model loads ----------------------------------


def run_error(capsys, argv):
    try:
        rc = main([str(a) for a in argv] + ["--no-progress"])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text\n")
    return path


def fake_run(tmp_path, iterations=(1,), run_config=False):
    """A directory shaped like a run's --save, with empty iteration directories."""
    root = tmp_path / "run"
    for it in iterations:
        d = root / f"iter_{it:07d}"
        d.mkdir(parents=True)
        (d / "jreg_complete.json").write_text(json.dumps({"iteration": it}))
        if run_config:
            (d / "run_config.yaml").write_text("model: {}\n")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iterations[-1]))
    return root


def test_no_checkpoint_dir(capsys, tmp_path, text):
    err = run_error(capsys, ["--load", tmp_path / "nope", "--text-file", text])
    assert "--load" in err and "no such directory" in err


def test_not_a_checkpoint_dir(capsys, tmp_path, text):
    err = run_error(capsys, ["--load", tmp_path, "--text-file", text])
    assert "not a torch_dist checkpoint directory" in err and "--save" in err


def test_an_iteration_dir_instead_of_the_run(capsys, tmp_path, text):
    root = fake_run(tmp_path, (5,))
    err = run_error(capsys, ["--load", root / "iter_0000005", "--text-file", text])
    assert "give its parent and --iteration 5" in err


def test_checkpoint_without_run_config(capsys, tmp_path, text):
    err = run_error(capsys, ["--load", fake_run(tmp_path), "--text-file", text])
    assert "run_config.yaml" in err and "cannot be rebuilt" in err


def test_missing_iteration(capsys, tmp_path, text):
    root = fake_run(tmp_path, (1, 2), run_config=True)
    err = run_error(capsys, ["--load", root, "--iteration", 7, "--text-file", text])
    assert "iteration 7" in err and "[1, 2]" in err


def test_trajectory_needs_one_run(capsys, tmp_path, text):
    root = fake_run(tmp_path, run_config=True)
    err = run_error(capsys, ["--load", root, root, "--all-iterations", "--text-file", text])
    assert "one run per trajectory" in err


def test_empty_text(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n\n")
    err = run_error(capsys, ["--load", fake_run(tmp_path, run_config=True), "--text-file", empty])
    assert "no tokens to evaluate" in err


# ---- damaged checkpoints: the messages name eval_jump's flags (--iteration), not the trainer's


def _damaged_copy(tmp_path, trained_checkpoints, damage):
    """A copy of the tp1 run (iterations 1..ITERS) with ``damage(newest iteration dir)``."""
    import shutil

    root = tmp_path / "run"
    shutil.copytree(trained_checkpoints["tp1"], root)
    damage(root / f"iter_{ITERS:07d}")
    return root


def _tool_error(script, argv):
    from checkpoint_runs import run_tool

    proc = run_tool(script, argv, check=False)
    err = proc.stderr.strip()
    assert proc.returncode == 2, proc.stdout + err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_torn_latest_checkpoint_names_iteration(trained_checkpoints, checkpoint_text, tmp_path):
    # a save torn after the tracker moved on: the tracker names ITERS, which has no marker
    root = _damaged_copy(
        tmp_path, trained_checkpoints, lambda d: (d / "jreg_complete.json").unlink()
    )
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    err = _tool_error(
        "eval_jump.py", ["--load", root, "--text-file", checkpoint_text[0], "--no-progress"]
    )
    assert "incomplete" in err and f"--iteration {ITERS - 1}" in err, err
    assert "--ckpt-step" not in err
    err = _tool_error("convert_to_hf.py", ["--load", root, "--output", tmp_path / "hf"])
    assert f"--iteration {ITERS - 1}" in err and "--ckpt-step" not in err, err
    assert not (tmp_path / "hf").exists()


def test_damaged_metadata_names_iteration(trained_checkpoints, checkpoint_text, tmp_path):
    root = _damaged_copy(
        tmp_path, trained_checkpoints, lambda d: (d / ".metadata").write_bytes(b"garbage")
    )
    err = _tool_error(
        "eval_jump.py", ["--load", root, "--text-file", checkpoint_text[0], "--no-progress"]
    )
    assert "metadata" in err and "--iteration" in err and "--ckpt-step" not in err, err
