"""Every flag value is checked where it is defined: a non-finite float, a value outside the
range its field declares, a ``--config`` YAML value of the wrong type, and a YAML file too
big or with aliases that expand without bound are refused in one line, exit 2, naming the
flag (or the key) and the value, before any work."""

import dataclasses
import subprocess
import sys
import time
import typing

import pytest
from trainer_runs import REPO, run_env

from megatron_jreg.commands import flags as cli
from megatron_jreg.config.model import ModelConfig
from megatron_jreg.config.run import BUILDERS, SECTIONS


def parse(argv):
    return cli.parse(SECTIONS, ["--data-path", "x"] + argv, build=BUILDERS)


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err


# (flag, value, the message's range): each of these used to get through parsing
BAD_FLAGS = [
    ("--jreg-lambda", "inf", "must be a finite number >= 0, got inf"),
    ("--jreg-lambda", "nan", "must be a finite number >= 0, got nan"),
    ("--jreg-alpha", "inf", "must be a finite number, got inf"),
    ("--rotary-base", "0", "must be > 0, got 0"),
    ("--rotary-base", "-5", "must be > 0, got -5"),
    ("--norm-epsilon", "-1", "must be > 0, got -1.0"),
    ("--norm-epsilon", "0", "must be > 0, got 0.0"),
    ("--init-method-std", "nan", "must be a finite number > 0, got nan"),
    ("--hidden-dropout", "1", "must be in [0, 1), got 1.0"),
    ("--attention-dropout", "-0.1", "must be in [0, 1), got -0.1"),
    ("--rotary-percent", "inf", "must be a finite number in (0, 1], got inf"),
    ("--num-query-groups", "0", "must be >= 1, got 0"),
    ("--ffn-hidden-size", "-1", "must be >= 1, got -1"),
    ("--max-position-embeddings", "0", "must be >= 1, got 0"),
    ("--vocab-size", "0", "must be >= 1, got 0"),
    ("--kv-channels", "0", "must be >= 1, got 0"),
    ("--moe-router-topk", "0", "must be >= 1, got 0"),
    ("--moe-aux-loss-coeff", "-1", "must be >= 0, got -1.0"),
    ("--moe-aux-loss-coeff", "inf", "must be a finite number >= 0, got inf"),
    ("--moe-ffn-hidden-size", "0", "must be >= 1, got 0"),
    ("--tensor-model-parallel-size", "0", "must be >= 1, got 0"),
    ("--num-layers-per-virtual-pipeline-stage", "0", "must be >= 1, got 0"),
    ("--distributed-timeout-minutes", "0", "must be >= 1, got 0"),
    ("--recompute-num-layers", "0", "must be >= 1, got 0"),
    ("--lr", "inf", "must be a finite number > 0, got inf"),
    ("--lr", "nan", "must be a finite number > 0, got nan"),
    ("--min-lr", "nan", "must be a finite number >= 0, got nan"),
    ("--lr-warmup-init", "-1", "must be >= 0, got -1.0"),
    ("--lr-warmup-fraction", "1.5", "must be in [0, 1], got 1.5"),
    ("--lr-decay-iters", "0", "must be >= 1, got 0"),
    ("--lr-wsd-decay-samples", "0", "must be >= 1, got 0"),
    ("--weight-decay", "-0.1", "must be >= 0, got -0.1"),
    ("--weight-decay", "inf", "must be a finite number >= 0, got inf"),
    ("--adam-beta1", "1", "must be in [0, 1), got 1.0"),
    ("--adam-beta2", "-0.5", "must be in [0, 1), got -0.5"),
    ("--adam-eps", "0", "must be > 0, got 0.0"),
    ("--clip-grad", "nan", "must be a finite number >= 0, got nan"),
    ("--clip-grad", "-1", "must be >= 0, got -1.0"),
    ("--clip-grad", "inf", "must be a finite number >= 0, got inf"),
    ("--initial-loss-scale", "0", "must be > 0, got 0.0"),
    ("--eval-iters", "-1", "must be >= 0, got -1"),
    ("--eval-interval", "-1", "must be >= 0, got -1"),
    ("--seed", "-1", "must be in [0, 4294967295], got -1"),
    ("--seed", str(2**32), f"must be in [0, 4294967295], got {2**32}"),
    ("--exit-duration-in-mins", "-1", "must be >= 0, got -1.0"),
    ("--exit-duration-in-mins", "nan", "must be a finite number >= 0, got nan"),
    ("--exit-interval", "0", "must be >= 1, got 0"),
    ("--train-samples", "-8", "must be >= 1, got -8"),
    ("--ckpt-step", "-1", "must be >= 0, got -1"),
    # Megatron-LM's flags: a value megatron-core would take on its own terms
    ("--num-dataset-builder-threads", "0", "must be >= 1, got 0"),
    ("--num-workers", "-1", "must be >= 0, got -1"),
    ("--tensorboard-queue-size", "0", "must be >= 1, got 0"),
    ("--decoupled-lr", "nan", "must be a finite number > 0, got nan"),
    ("--loss-scale", "inf", "must be a finite number > 0, got inf"),
]


@pytest.mark.parametrize("flag,value,message", BAD_FLAGS, ids=[f"{f} {v}" for f, v, _ in BAD_FLAGS])
def test_bad_flag_value_is_refused_naming_flag_and_range(flag, value, message, capsys):
    assert f"error: {flag} {message}" in refused([flag, value], capsys)


@pytest.mark.parametrize("argv", [
    ["--clip-grad", "0"],  # 0 = no clipping, as documented
    ["--eval-iters", "0"], ["--eval-interval", "0"], ["--jreg-lambda", "0"],
    ["--hidden-dropout", "0"], ["--adam-beta1", "0"], ["--seed", "0"],
    ["--exit-duration-in-mins", "0"], ["--jreg-alpha", "-2"], ["--lr-warmup-fraction", "1"],
])
def test_edge_values_that_mean_something_are_accepted(argv):
    parse(argv)


# --config values: (YAML text, the message)
BAD_YAML = [
    ("jreg: {alpha: [1, 2]}", "jreg.alpha: expected a number, got [1, 2]"),
    ("num_layers: true", "num_layers: expected an integer, got True"),
    ("model: {num_layers: 2.5}", "model.num_layers: expected an integer, got 2.5"),
    ("lr: fast", "lr: expected a number, got 'fast'"),
    ("lr: {peak: 1}", "lr: expected a number, got {'peak': 1}"),
    ("seed: null", "seed: expected an integer, got None"),
    ("exit_on_nan: 1", "exit_on_nan: expected true or false, got 1"),
    ("data_path: some_prefix", "data_path: expected a list, got 'some_prefix'"),
    ("data_path: [a, [b]]", "data_path: expected a string, got ['b']"),
    ("normalization: no", "normalization: expected a string, got False"),
    ("model: {normalization: BatchNorm}",
     "model.normalization must be one of LayerNorm, RMSNorm, got 'BatchNorm'"),
    ("jreg: {lam: .inf}", "jreg.lam must be a finite number >= 0, got inf"),
    ("lr: .nan", "lr must be a finite number > 0, got nan"),
    ("model: {rotary_base: 0}", "model.rotary_base must be > 0, got 0"),
    ("clip_grad: -1", "clip_grad must be >= 0, got -1"),
    ("eval_iters: -3", "eval_iters must be >= 0, got -3"),
    ("lr: 1" + "0" * 400, "lr must be a finite number > 0, got inf"),  # no float holds it
    # the message stays one short line, whatever the value
    ("jreg: {alpha: [" + ", ".join(["1"] * 1000) + "]}",
     "jreg.alpha: expected a number, got [" + "1, " * 25 + "1...\n"),
    # set twice: PyYAML keeps the last one, a flat key and its sectioned twin were merged
    ("model:\n  num_layers: 2\n  num_layers: 3", "num_layers is set twice; keep one"),
    ("model: {num_layers: 2}\nmodel: {hidden_size: 32}", "model is set twice; keep one"),
    ("lr: 0.001\noptim: {lr: 0.002}", "optim.lr is set twice (lr and optim.lr); keep one"),
    ("num-layers: 2\nnum_layers: 3",
     "model.num_layers is set twice (num-layers and num_layers); keep one"),
]


@pytest.mark.parametrize("text,message", BAD_YAML, ids=[t[:40] for t, _ in BAD_YAML])
def test_bad_yaml_value_is_refused_naming_the_key(text, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text + "\n")
    assert f"error: --config {path}: {message}" in refused(["--config", str(path)], capsys)


def test_yaml_numbers_are_read_as_the_field_says(tmp_path):
    path = tmp_path / "run.yaml"
    # YAML 1.1 reads 1e-4 as a string: the float field takes it as the flag would
    path.write_text("lr: 1e-4\nmin_lr: 0\nclip_grad: 1\ndata_path: [0.7, a, 0.3, b]\n")
    c = cli.parse(SECTIONS, ["--config", str(path)], build=BUILDERS)
    assert c["optim"].lr == 1e-4 and isinstance(c["optim"].clip_grad, float)
    assert c["data"].data_path == ["0.7", "a", "0.3", "b"]


def billion_laughs(levels: int = 9) -> str:
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("text,message", [
    (billion_laughs(), "aliases expand to more than"),
    ("lr: &a [*a]\n", "aliases expand to more than"),  # an alias of itself: endless
    ("[" * 200_000, "nested too deeply"),
    ("# padding\n" * 110_000, "larger than 1 MiB"),
], ids=["billion-laughs", "self-alias", "deep", "too-big"])
def test_config_file_is_bounded(text, message, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    start = time.monotonic()
    err = refused(["--config", str(path)], capsys)
    assert message in err and time.monotonic() - start < 10, err


def test_a_few_aliases_are_fine(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim: {lr: &peak 0.001, min_lr: *peak}\n")
    assert parse(["--config", str(path)])["optim"].min_lr == 0.001


def test_every_numeric_trainer_field_declares_a_range():
    # a count, a size, a rate: each says what it may be; alpha is any finite number
    # (a negative alpha weights the first layers most)
    any_finite = {("jreg", "alpha")}
    missing = []
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            kinds = set(typing.get_args(typing.get_type_hints(cls)[field.name])) or {
                typing.get_type_hints(cls)[field.name]}
            numeric = kinds & {int, float}
            bounded = {"min", "gt", "max", "lt", "choices"} & set(field.metadata)
            if numeric and not bounded and (section, field.name) not in any_finite:
                missing.append(f"{section}.{field.name}")
    assert missing == []


def test_a_config_built_in_code_meets_the_same_bounds():
    with pytest.raises(ValueError, match="--norm-epsilon must be > 0, got 0"):
        ModelConfig(norm_epsilon=0)
    with pytest.raises(ValueError, match="--hidden-dropout must be a finite number"):
        ModelConfig(hidden_dropout=float("nan"))


@pytest.mark.parametrize("argv,message", [
    (["--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["--rotary-base", "0"], "--rotary-base must be > 0, got 0"),
])
def test_trainer_refuses_before_any_work(argv, message, demo_data):
    # the trainer itself: one line, exit 2, no step (it used to train into nan or inf)
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train", "--model-preset", "tiny",
                           "--data-path", demo_data, "--train-iters", "2"] + argv,
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert message in proc.stderr and "iteration" not in proc.stdout
