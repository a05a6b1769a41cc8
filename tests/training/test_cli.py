"""Flags generated from the config dataclasses, YAML underneath, presets below both."""

import dataclasses

import pytest
import yaml

from megatron_jreg import cli
from megatron_jreg.model.config import PRESETS
from megatron_jreg.training.config import BUILDERS, SECTIONS


def parse(argv):
    return cli.parse(SECTIONS, argv, build=BUILDERS)


def test_megatron_flag_names_and_types():
    c = parse(["--data-path", "0.7", "a_text_document", "0.3", "b_text_document",
               "--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
               "--lr", "1e-4", "--adam-beta2", "0.98", "--jreg-lambda", "0.5",
               "--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp",
               "--no-load-optim", "--no-exit-on-nan"])
    assert c["data"].data_path == ["0.7", "a_text_document", "0.3", "b_text_document"]
    assert c["parallel"].tensor_model_parallel_size == 2 and c["parallel"].sequence_parallel
    assert c["model"].bf16 and c["optim"].lr == 1e-4 and c["optim"].adam_beta2 == 0.98
    assert c["jreg"].lam == 0.5 and c["parallel"].recompute_modules == ["core_attn", "mlp"]
    assert c["checkpoint"].no_load_optim is True and c["training"].exit_on_nan is False


def test_precedence_preset_yaml_flags(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"model_preset": "170m", "num_layers": 6},
                                   "jreg": {"alpha": 0.3}, "lr": 2e-4, "data_path": ["x"]}))
    c = parse(["--config", str(cfg), "--num-layers", "8"])
    assert c["model"].hidden_size == PRESETS["170m"]["hidden_size"]  # from the preset
    assert c["model"].num_layers == 8  # the flag beats YAML, YAML beats the preset
    assert c["jreg"].alpha == 0.3 and c["optim"].lr == 2e-4


def test_resolved_config_round_trips():
    c = parse(["--data-path", "x", "--model-preset", "1b", "--jreg-weighting", "power"])
    again = cli.from_yaml_text(cli.to_yaml(c), SECTIONS)
    for name in SECTIONS:
        assert dataclasses.asdict(again[name]) == dataclasses.asdict(c[name])


@pytest.mark.parametrize("argv,message", [
    (["--data-path", "x", "--model-preset", "7b"], "--model-preset '7b'"),
    (["--data-path", "x", "--sequence-parallel"], "--sequence-parallel needs"),
    (["--data-path", "x", "--bf16", "--fp16"], "exclusive"),
    (["--data-path", "x", "--jreg-lambda", "-1"], "--jreg-lambda must be >= 0"),
])
def test_bad_flags_exit_2_with_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_yaml_unknown_key(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("learning_rate: 1\n")
    with pytest.raises(SystemExit):
        parse(["--config", str(cfg), "--data-path", "x"])
    assert "unknown setting 'learning_rate'" in capsys.readouterr().err
