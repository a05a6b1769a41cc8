"""Megatron-LM's layouts that are not a torch_dist ``iter_N`` directory are recognised by the
catalog (catalog.scan) and named, or read, the same way by every reader:

- its legacy ``--ckpt-format torch`` save (``iter_N/mp_rank_00/model_optim_rng.pt``,
  ``mp_rank_00_000/`` with pipeline stages) is its own kind, not a torn save and not "no
  checkpoint": one line naming Megatron-LM's conversion (``--ckpt-convert-format
  torch_dist --ckpt-convert-save``, megatron/training/training.py core_v0.16.1);
- its ``release`` tracker and ``release/`` directory are its released weights, which
  Megatron-LM reads as iteration 0, weights only (checkpointing.py ``read_metadata``,
  ``get_checkpoint_name``): read so here when torch_dist, named in one line otherwise."""

import json
import os
import shutil

import pytest
import torch
from checkpoint_runs import ITERS, REPO, run_env

import forked_trainer
from megatron_jreg.checkpoint import catalog, faults, formats, run_configs
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir
from megatron_jreg.training import source

CONVERT = "--ckpt-format torch --ckpt-convert-format torch_dist --ckpt-convert-save OUT"


def _legacy(root, name, rank_dir="mp_rank_00"):
    """An iteration directory as Megatron-LM's legacy torch format saves it."""
    rank = os.path.join(root, name, rank_dir)
    os.makedirs(rank)
    torch.save({"iteration": 10, "checkpoint_version": 3.0, "model": {}},
               os.path.join(rank, "model_optim_rng.pt"))


def _tracker(root, text):
    with open(os.path.join(root, catalog.TRACKER), "w") as f:
        f.write(text)


@pytest.mark.parametrize("rank_dir,tracked", [("mp_rank_00", True), ("mp_rank_00_000", True),
                                              ("mp_rank_00", False)],
                         ids=["tp", "pp", "no_tracker"])
def test_a_legacy_torch_save_is_named_with_its_conversion(tmp_path, rank_dir, tracked):
    root = str(tmp_path / "ckpt")
    _legacy(root, "iter_0000010", rank_dir)
    if tracked:
        _tracker(root, "10")
    found = catalog.scan(root)
    assert 10 not in found.torn and found.holds_checkpoint and "iter_0000010" in found.held
    with pytest.raises(faults.LegacyTorchFormat) as err:
        found.resolve()
    line = faults.phrase(err.value, faults.TOOLS)
    assert "\n" not in line and "torn" not in line, line
    assert line.startswith(f"{root}/iter_0000010 is Megatron-LM's legacy --ckpt-format torch "
                           f"checkpoint ({rank_dir}/model_optim_rng.pt)"), line
    assert f"--load {root} --ckpt-step 10 --use-checkpoint-args {CONVERT})" in line, line
    # the trainer's reading names the flag it was given
    choice = source.Choice("--pretrained-checkpoint", root, None, True)
    with pytest.raises(faults.LegacyTorchFormat,
                       match="pass --pretrained-checkpoint OUT/torch_dist"):
        source.read(choice, verify=True)
    # and so does the tools' reading of every iteration
    with pytest.raises(faults.LegacyTorchFormat):
        run_configs.checkpoint_sources(root, all_iterations=True)


def test_a_legacy_iteration_given_itself_is_named(tmp_path):
    _legacy(str(tmp_path / "ckpt"), "iter_0000010")
    with pytest.raises(faults.LegacyTorchFormat, match="--ckpt-step 10 --use-checkpoint-args"):
        catalog.scan(str(tmp_path / "ckpt" / "iter_0000010")).resolve()


def test_release_in_legacy_format_or_missing_is_named(tmp_path):
    root = str(tmp_path / "ckpt")
    os.makedirs(root)
    _tracker(root, "release\n")
    with pytest.raises(faults.ReleaseMissing) as err:
        catalog.scan(root).resolve()
    line = str(err.value)
    assert "\n" not in line and "says 'release'" in line and "there is no such directory" in line
    _legacy(root, "release")
    with pytest.raises(faults.LegacyTorchFormat) as err:
        catalog.scan(root).resolve()
    assert str(err.value).startswith(f"{root}/release is Megatron-LM's legacy")
    assert "--ckpt-step" not in str(err.value)


@pytest.fixture
def released(checkpoint, tmp_path):
    """Megatron-LM's released weights in torch_dist: the run's last iteration as release/,
    the tracker saying release."""
    root = tmp_path / "released"
    root.mkdir()
    shutil.copytree(iteration_dir(checkpoint, ITERS), root / catalog.RELEASE)
    _tracker(str(root), "release")
    return str(root)


def test_release_reads_as_iteration_zero_weights_only(released):
    read = formats.read(released)
    assert (read.iteration, read.path, read.ref.release) == (0, os.path.join(released, "release"),
                                                             True)
    assert read.format.embedding_rows and read.ref.note and "iteration 0" in read.ref.note
    every = run_configs.checkpoint_sources(released, all_iterations=True)
    assert [(s.iteration, s.path) for s in every] == [(0, read.path)]
    for flag in ("--load", "--pretrained-checkpoint"):
        start = source.read(source.Choice(flag, released, None, flag != "--load"), verify=True)
        assert start.weights_only and start.source.iteration == 0


def _eval_jump(tmp_path, root):
    text = tmp_path / "eval.txt"
    text.write_text("the jump of the last layer\nresidual state of a token norm\n")
    env = dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
               TOKENIZERS_PARALLELISM="false")
    return forked_trainer.run_tool("tools/eval_jump.py",
                                   ["--load", str(root), "--text-file", str(text), "--json",
                                    str(tmp_path / "jump.json"), "--no-progress"], env, timeout=600)


def test_eval_jump_reads_release_and_names_legacy(released, tmp_path):
    proc = _eval_jump(tmp_path, released)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "jump.json").read_text())["iteration"] == 0
    legacy = tmp_path / "legacy"
    _legacy(str(legacy), "iter_0000010")
    _tracker(str(legacy), "10")
    proc = _eval_jump(tmp_path, legacy)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("eval_jump: error: "), proc.stderr[-3000:]
    assert "Megatron-LM's legacy --ckpt-format torch" in lines[0], lines
    assert "pass --load OUT/torch_dist" in lines[0], lines
