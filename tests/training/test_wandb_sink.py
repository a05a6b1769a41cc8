"""The Weights & Biases sink of a real run (--wandb-project, --wandb-exp-name) against the
run's own JSONL metrics, the directory wandb writes to (--wandb-save-dir), and the
checkpoint the run saves under --ckpt-format torch_dist.

wandb is an optional package (not installed here): a stand-in ``wandb`` module in the run's
working directory (the first entry of ``sys.path`` under ``python -m``) records every call
as a JSON line. It shadows an installed wandb, so the run never reaches the network."""

import json
import os
import sys

import pytest
import yaml
from trainer_runs import base_args, run_env

import forked_trainer

FAKE_WANDB = '''"""Stand-in for wandb: each call appended as a JSON line to $FAKE_WANDB_CALLS."""
import json
import os
import sys


def _record(**call):
    with open(os.environ["FAKE_WANDB_CALLS"], "a") as f:
        f.write(json.dumps(call) + "\\n")


class Run:
    def log(self, data, step=None, commit=None):
        _record(call="log", data=data, step=step)

    def finish(self, exit_code=None, quiet=None):
        _record(call="finish")


def init(**kwargs):
    _record(call="init", kwargs=kwargs)
    return Run()
'''
ITERS, LAYERS = 3, 4  # the tiny preset's layers


@pytest.fixture(scope="module")
def wandb_run(demo_data, tmp_path_factory):
    """3 steps, logged every step, validated at step 2, saved at the end: (the recorded
    wandb calls, the JSONL rows, the iteration directory of the checkpoint)."""
    root = tmp_path_factory.mktemp("wandb_run")
    (root / "wandb.py").write_text(FAKE_WANDB)
    calls, metrics, ckpt = root / "calls.jsonl", root / "metrics.jsonl", root / "ckpt"
    argv = base_args(demo_data, train_iters=ITERS, eval_interval=2, eval_iters=1,
                     metrics_file=metrics, save=ckpt, ckpt_format="torch_dist",
                     wandb_project="jreg-tests", wandb_exp_name="tiny-wandb")
    proc = forked_trainer.run(argv, root, dict(run_env(), FAKE_WANDB_CALLS=str(calls)), 600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    read = [[json.loads(line) for line in open(path)] for path in (calls, metrics)]
    return read[0], read[1], ckpt / f"iter_{ITERS:07d}"


def expected_train_log(row):
    """Megatron-LM's W&B keys (its TensorBoard tags) for a JSONL train row."""
    out = {"lm loss": row["lm_loss"], "jreg/penalty": row["jreg_penalty"], "jreg/R": row["R"],
           "jreg/zeta_L": row["zeta_L"], "jreg/zeta_L-1": row["zeta_L-1"],
           "jreg/zeta_L-2": row["zeta_L-2"], "learning-rate": row["lr"],
           "grad-norm": row["grad_norm"], "throughput/tokens_per_s": row["tokens_per_s"],
           "memory/GiB": row["memory_gib"]}
    out.update({f"jreg/psi/layer_{layer:02d}": psi for layer, psi in enumerate(row["psi"], 1)})
    # the seconds of an evaluation or a save in the row's window, when there was one
    out.update({f"time/{key}": row[key] for key in ("eval_seconds", "save_seconds") if key in row})
    return out


def test_init_names_the_project_and_run_and_carries_the_run_config(wandb_run):
    calls, _, saved = wandb_run
    init = calls[0]
    assert init["call"] == "init" and [c["call"] for c in calls].count("init") == 1
    kwargs = init["kwargs"]
    assert set(kwargs) == {"project", "name", "config", "dir"}
    assert (kwargs["project"], kwargs["name"]) == ("jreg-tests", "tiny-wandb")
    # no --wandb-save-dir: --save's wandb directory (Megatron-LM's default), made by the
    # trainer (the stand-in makes nothing)
    assert kwargs["dir"] == str(saved.parent / "wandb")
    assert os.path.isdir(kwargs["dir"])
    # the config is the run's, as its checkpoint records it
    assert kwargs["config"] == yaml.safe_load((saved / "run_config.yaml").read_text())
    assert kwargs["config"]["logging"]["wandb_exp_name"] == "tiny-wandb"


def test_each_logged_step_is_the_jsonl_record_of_that_step(wandb_run):
    """Every train and validation record of the metrics file, at its iteration as the W&B
    step, with the same numbers under Megatron-LM's names, in the run's order; then the
    run is finished once."""
    calls, rows, _ = wandb_run
    want = []
    for row in rows:
        if "lm_loss" in row:
            want.append((row["iteration"], expected_train_log(row)))
        else:
            want.append((row["iteration"], {"validation/lm loss": row["validation_lm_loss"],
                                            "validation/zeta_L": row["validation_zeta_L"],
                                            "time/validation_seconds": row["validation_seconds"]}))
    assert [it for it, _ in want] == [1, 2, 2, 3]  # a validation record at step 2
    assert "time/eval_seconds" in want[3][1]  # step 3's window held step 2's evaluation
    assert len(want[0][1]) == 10 + LAYERS
    logs = [(c["step"], c["data"]) for c in calls if c["call"] == "log"]
    assert logs == want
    assert [c["call"] for c in calls] == ["init"] + ["log"] * len(want) + ["finish"]


def test_ckpt_format_torch_dist_is_what_is_on_disk(wandb_run):
    """megatron-core's torch_dist format: metadata.json naming the backend, the sharded
    tensors in .distcp files (PyTorch distributed checkpoint), beside the run's files."""
    saved = wandb_run[2]
    assert json.loads((saved / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert any(name.endswith(".distcp") for name in os.listdir(saved)), os.listdir(saved)
    assert (saved / ".metadata").is_file()  # torch.distributed.checkpoint's own index


def test_wandb_save_dir_is_where_wandb_writes(tmp_path, monkeypatch):
    """The dir wandb.init gets from the trainer's flags, through the trainer's metrics
    sinks (in this process, with the stand-in module): --wandb-save-dir; without it --save's
    wandb directory, as in Megatron-LM; with neither, wandb's own default (None)."""
    from megatron_jreg.commands.train import from_argv
    from megatron_jreg.training.metrics import build_metrics_logger

    calls = tmp_path / "calls.jsonl"
    (tmp_path / "wandb.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setenv("FAKE_WANDB_CALLS", str(calls))
    own, save = str(tmp_path / "own"), str(tmp_path / "ckpt")
    cases = [(["--wandb-save-dir", own, "--save", save], own),
             (["--save", save], os.path.join(save, "wandb")), ([], None)]
    for argv, expected in cases:
        cfg = from_argv(["--data-path", "x", "--wandb-project", "p"] + argv)
        assert cfg.wandb_dir() == expected
        # the trainer makes and checks it before any work, as every output it writes
        assert [o for o in cfg.outputs() if o[0] == "--wandb-save-dir"] == (
            [("--wandb-save-dir", expected, True, False)] if expected else [])
        build_metrics_logger(cfg.logging, 1, 0, cfg.to_dict(), cfg.wandb_dir()).close()
    inits = [json.loads(line)["kwargs"]["dir"] for line in open(calls)
             if json.loads(line)["call"] == "init"]
    assert inits == [expected for _, expected in cases]
