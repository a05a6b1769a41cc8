"""Megatron-LM's torch_dist checkpoints here, local-spec and Transformer Engine shaped.

A run of ours stopped at iteration 4 is written out again as Megatron-LM writes a
checkpoint (megatron_lm_shaped.py: its args, opt_param_scheduler, sharded rng_state, content
metadata; none of our files), with and without Transformer Engine's core-attention extra
state, without the distributed optimizer and with it in both of its formats. Resumed here,
the next losses, learning rates and Psi equal those of an uninterrupted run; the samples
consumed and the FLOPs so far carry on. The same checkpoint starts a run through
``--pretrained-checkpoint --use-checkpoint-args`` and is read by eval_jump and convert_to_hf
exactly as the checkpoint of ours holding the same weights.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from trainer_runs import REPO, base_args, read_metrics, run_env, train

from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir

HERE = os.path.dirname(os.path.abspath(__file__))
COMMON = dict(train_iters=8, save_interval=4, seq_length=32)
# name: (processes, flags, Megatron-LM's distributed-optimizer format or "none")
LAYOUTS = {
    "tp1": (1, {}, "none"),
    "dp2_dp_reshardable": (2, {"use_distributed_optimizer": True}, "dp_reshardable"),
    "tp2_fully_reshardable": (2, {"use_distributed_optimizer": True,
                                  "tensor_model_parallel_size": 2}, "fully_reshardable"),
}
_RUNS = {}


def _source(demo_data, tmp_path_factory, layout):
    """(full run's metrics and save, our checkpoint of the run stopped at 4) per layout."""
    if layout not in _RUNS:
        nproc, extra, _ = LAYOUTS[layout]
        root = tmp_path_factory.mktemp(layout)
        full = root / "full.jsonl"
        train(base_args(demo_data, metrics_file=full, save=root / "full", **COMMON, **extra),
              nproc=nproc)
        train(base_args(demo_data, save=root / "ours", exit_interval=4, **COMMON, **extra),
              nproc=nproc)
        _RUNS[layout] = (read_metrics(full), root / "full", root / "ours")
    return _RUNS[layout]


def write_megatron_lm(demo_data, ours, target, layout, spec):
    nproc, extra, sharding = LAYOUTS[layout]
    argv = [os.path.join(HERE, "megatron_lm_shaped.py"), str(target), sharding, spec, "--",
            *base_args(demo_data, load=ours, **COMMON, **extra)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(nproc)]
    proc = subprocess.run(launcher + argv, cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "wrote iteration 4 consumed 32" in proc.stdout
    it = iteration_dir(str(target), 4)
    assert not any(os.path.exists(os.path.join(it, n)) for n in
                   ("run_config.yaml", "jreg_manifest.json", "jreg_complete.json", "rng"))
    return target


def _common(path):
    return torch.load(os.path.join(path, "common.pt"), weights_only=False)


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_lm_checkpoint_resumes_exactly(demo_data, tmp_path, tmp_path_factory, layout,
                                                spec):
    nproc, extra, _ = LAYOUTS[layout]
    full, full_save, ours = _source(demo_data, tmp_path_factory, layout)
    target = write_megatron_lm(demo_data, ours, tmp_path / "mlm", layout, spec)
    part = tmp_path / "part.jsonl"
    proc = train(base_args(demo_data, load=target, save=tmp_path / "resumed", metrics_file=part,
                           **COMMON, **extra), nproc=nproc)
    rows = read_metrics(part)
    assert [r["iteration"] for r in rows] == [5, 6, 7, 8]
    for x, y in zip(full[4:], rows):
        assert (y["lm_loss"], y["lr"], y["psi"]) == (x["lm_loss"], x["lr"],
                                                     x["psi"]), x["iteration"]
    assert y["consumed_samples"] == x["consumed_samples"] == 64
    assert "random state not restored" not in proc.stdout
    extra_line = ("the checkpoint's _extra_state entries (decoder.layers.self_attention."
                  "core_attention._extra_state) are not used by this model")
    assert (extra_line in proc.stdout) == (spec == "te"), proc.stdout
    # the FLOPs so far go on from the checkpoint's count: 4 more steps of the full run's 8
    flops = _common(iteration_dir(str(tmp_path / "resumed"),
                                  8))["num_floating_point_operations_so_far"]
    full_flops = _common(iteration_dir(str(full_save), 8))["num_floating_point_operations_so_far"]
    assert flops - 1234.5 == pytest.approx(full_flops / 2, rel=1e-12)


def test_megatron_lm_checkpoint_starts_a_run_with_its_args(demo_data, tmp_path, tmp_path_factory):
    """--pretrained-checkpoint --use-checkpoint-args on Megatron-LM's checkpoint builds the
    model its args describe (no model flag given) and trains exactly as from our checkpoint
    of the same weights; a model flag that differs is named."""
    _, _, ours = _source(demo_data, tmp_path_factory, "tp1")
    target = write_megatron_lm(demo_data, ours, tmp_path / "mlm", "tp1", "te")
    losses = []
    for source in (target, ours):
        metrics = tmp_path / f"{source.name}.jsonl"
        proc = train(base_args(demo_data, model_preset=None, pretrained_checkpoint=source,
                               use_checkpoint_args=True, train_iters=3, seq_length=32,
                               metrics_file=metrics))
        assert "fine-tuning from --pretrained-checkpoint" in proc.stdout
        losses.append([r["lm_loss"] for r in read_metrics(metrics)])
    assert losses[0] == losses[1] and len(losses[0]) == 3
    proc = train(base_args(demo_data, model_preset=None, num_layers=3, load=target,
                           use_checkpoint_args=True, seq_length=32), check=False)
    assert proc.returncode == 2
    assert "--num-layers 3 differs from the checkpoint's 4" in proc.stderr, proc.stderr[-2000:]
    # a resume with a wrong architecture is named by its flag, not "may be corrupt"
    proc = train(base_args(demo_data, num_layers=3, load=target, seq_length=32), check=False)
    assert proc.returncode == 2
    assert "the checkpoint's model differs: --num-layers 4 (this run: 3)" in proc.stderr


def test_eval_jump_and_convert_to_hf_read_megatron_lm_checkpoints(demo_data, tmp_path,
                                                                  tmp_path_factory):
    """The tools give the same numbers and weights from Megatron-LM's checkpoint as from
    ours holding the same weights."""
    from safetensors.torch import load_file

    import forked_trainer

    _, _, ours = _source(demo_data, tmp_path_factory, "tp2_fully_reshardable")
    target = write_megatron_lm(demo_data, ours, tmp_path / "mlm", "tp2_fully_reshardable", "te")
    reports, weights = [], []
    for source in (target, ours):
        out = tmp_path / f"{source.name}.json"
        proc = forked_trainer.run_tool("tools/eval_jump.py", [
            "--load", str(source), "--data-path", demo_data, "--seq-length", "32",
            "--max-tokens", "512", "--json", str(out), "--no-progress"], run_env(), timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        report = json.loads(out.read_text())
        reports.append(report[0] if isinstance(report, list) else report)
        hf = tmp_path / f"{source.name}-hf"
        proc = forked_trainer.run_tool("tools/convert_to_hf.py", [
            "--load", str(source), "--output", str(hf), "--no-tokenizer"], run_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights.append(load_file(str(hf / "model.safetensors")))
    assert reports[0]["displacement"] == reports[1]["displacement"]
    assert len(reports[0]["displacement"]) == 4 and reports[0]["tokens"] == 512
    assert reports[0]["jump_rate"] == reports[1]["jump_rate"]
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name


def test_a_checkpoint_without_random_state_says_so(demo_data, tmp_path, tmp_path_factory):
    """Megatron-LM's --no-save-rng: the resume restores the rest and says in one line that
    the random state starts from --seed (an earlier version stopped on it or skipped it
    silently)."""
    _, _, ours = _source(demo_data, tmp_path_factory, "tp1")
    target = write_megatron_lm(demo_data, ours, tmp_path / "mlm", "tp1", "local-norng")
    proc = train(base_args(demo_data, load=target, **COMMON))
    lines = [l for l in proc.stdout.splitlines() if "random state not restored" in l]
    assert lines == [f"random state not restored: {iteration_dir(str(target), 4)} holds none "
                     "(saved without it); it starts from --seed"]


def test_dp_reshardable_optimizer_state_names_its_layout(demo_data, tmp_path, tmp_path_factory):
    """Megatron-LM's default format of the distributed optimizer (ours too now) reloads at
    the same TP/PP only: another layout is refused naming both and the ways on; the weights
    alone load at any layout."""
    _, _, ours = _source(demo_data, tmp_path_factory, "dp2_dp_reshardable")
    flags = dict(load=ours, use_distributed_optimizer=True, tensor_model_parallel_size=2, **COMMON)
    proc = train(base_args(demo_data, **flags), nproc=2, check=False)
    assert proc.returncode != 0  # torchrun's status for a rank that exits 2
    assert ("holds the distributed optimizer's state as dp_reshardable, which loads only at the "
            "layout that saved it (TP 1 PP 1; this run TP 2 PP 1): resume at that layout, or "
            "pass --no-load-optim") in proc.stderr
    train(base_args(demo_data, no_load_optim=True, **flags), nproc=2)
