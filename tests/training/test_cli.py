"""Flags generated from the config dataclasses, YAML underneath, presets below both."""

import dataclasses

import pytest
import yaml

from megatron_jreg.commands import flags as cli
from megatron_jreg.config.model import PRESETS
from megatron_jreg.config.run import BUILDERS, SECTIONS


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
    # (--sequence-parallel at TP 1 is turned off with a printed line, as in Megatron-LM:
    # tests/training/test_megatron_lm_flags.py)
    (["--data-path", "x", "--rampup-batch-size", "16", "16", "1000"],
     "--rampup-batch-size: not supported yet"),
    (["--data-path", "x", "--bf16", "--fp16"], "exclusive"),
    (["--data-path", "x", "--jreg-lambda", "-1"], "--jreg-lambda must be >= 0"),
    # megatron-core features JREG does not support yet: refused by name, not "unrecognized"
    (["--data-path", "x", "--cp-comm-type", "ring"], "--cp-comm-type ring: choose among"),
    # (mixture of experts is supported: docs/families.md; its bad settings are refused in
    # tests/training/test_megatron_lm_flags.py)
    (["--data-path", "x", "--num-experts", "0"], "--num-experts must be >= 1"),
    (["--data-path", "x", "--expert-model-parallel-size", "0"],
     "--expert-model-parallel-size must be >= 1"),
    (["--data-path", "x", "--transformer-impl", "te"], "--transformer-impl 'te': choose one of"),
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


def test_tp_must_divide_the_vocabulary_multiple(monkeypatch):
    """The vocabulary is padded to --make-vocab-size-divisible-by whatever the TP size, so
    a TP that does not divide it is refused before any work, with the multiple that fits."""
    from megatron_jreg.training.experiment import ExperimentConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    c = parse(["--data-path", "x", "--tensor-model-parallel-size", "2",
               "--make-vocab-size-divisible-by", "3"])
    with pytest.raises(ValueError, match=r"does not divide --make-vocab-size-divisible-by 3.*"
                                         r"pass --make-vocab-size-divisible-by 6"):
        ExperimentConfig.from_sections(c).validate()


def test_padded_vocabulary_does_not_depend_on_tp():
    c = parse(["--data-path", "x", "--vocab-size", "259", "--tensor-model-parallel-size", "2"])
    assert c["model"].padded_vocab_size() == 384  # 128 * 3, not 256 * 2
    c = parse(["--data-path", "x", "--vocab-size", "259", "--make-vocab-size-divisible-by", "64"])
    assert c["model"].padded_vocab_size() == 320
    assert "--padded-vocab" not in cli.build_parser(SECTIONS).format_help()  # set by the trainer


def test_transformer_impl_auto_resolves_to_what_is_installed():
    from megatron_jreg.config.model import resolve_transformer_impl, transformer_engine_available

    assert parse(["--data-path", "x"])["model"].transformer_impl == "auto"
    impl, why = resolve_transformer_impl("auto")
    if transformer_engine_available():
        assert impl == "transformer_engine"
    else:
        assert impl == "local" and "not installed" in why
        with pytest.raises(ValueError, match="needs Transformer Engine installed"):
            resolve_transformer_impl("transformer_engine")
    assert resolve_transformer_impl("local")[0] == "local"


def test_trainer_help_runs_and_lists_every_flag():
    """`python -m megatron_jreg.train --help` as a user types it (a % in a help text once
    crashed argparse's formatter)."""
    import subprocess
    import sys

    from trainer_runs import REPO, run_env

    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train", "--help"], cwd=REPO,
                          env=run_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for cls in SECTIONS.values():
        for field in dataclasses.fields(cls):
            if field.metadata.get("cli") is False:
                assert f"--{field.name.replace('_', '-')}" not in proc.stdout
            elif "flag" in field.metadata:
                assert field.metadata["flag"] in proc.stdout, field.metadata["flag"]
    assert "default 10% of decay" in proc.stdout


@dataclasses.dataclass(kw_only=True)
class _ToolConfig:
    """A tool's config, for the tests of ``cli.tool_parser``."""

    path: str = dataclasses.field(metadata={"positional": True})
    """the file to read"""
    out: str = dataclasses.field(metadata={"group": "output", "metavar": "OUT.json"})
    """where to write"""
    size: int = 3
    """how many (100% of them)"""
    names: list = dataclasses.field(default_factory=lambda: ["a"], metadata={"group": "output"})
    """the names"""
    mode: str = dataclasses.field(default="auto", metadata={
        "choices": ("auto", "fast"), "default_help": "fast when it can", "help": "the mode"})
    quiet: bool = False
    first: bool = dataclasses.field(default=False, metadata={"exclusive": "which", "help": "x"})
    last: bool = dataclasses.field(default=False, metadata={"exclusive": "which", "help": "y"})
    state: int = dataclasses.field(default=0, metadata={"cli": False})


def _tool(argv):
    return cli.tool_values({None: _ToolConfig}, argv, prog="tool", epilog="exit status: 0")[None]


def test_tool_flags_positional_required_switch_defaults():
    v = _tool(["in.csv", "--out", "o.json"])
    assert v == {"path": "in.csv", "out": "o.json", "size": 3, "names": ["a"], "mode": "auto",
                 "quiet": False, "first": False, "last": False}
    assert _ToolConfig(**v).state == 0  # cli=False: no flag, the dataclass default
    v = _tool(["--out", "o", "--size", "5", "--names", "x", "y", "--quiet", "in.csv", "--first"])
    assert (v["path"], v["size"], v["names"], v["quiet"], v["first"]) == ("in.csv", 5, ["x", "y"],
                                                                         True, True)


@pytest.mark.parametrize("argv,message", [
    (["in.csv"], "tool: error: the following arguments are required: --out"),
    (["--out", "o"], "tool: error: the following arguments are required: path"),
    (["in.csv", "--out", "o", "--mode", "slow"], "argument --mode: invalid choice: 'slow'"),
    (["in.csv", "--out", "o", "--first", "--last"],
     "argument --last: not allowed with argument --first"),
    (["in.csv", "--out", "o", "--state", "1"], "unrecognized arguments: --state 1"),
    (["in.csv", "--ou", "o"], "required: --out"),  # no abbreviations
])
def test_tool_errors_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        _tool(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and err.count("\n") == 1 and "usage" not in err


def test_tool_help_docstrings_defaults_groups_epilog():
    text = " ".join(cli.tool_parser({None: _ToolConfig}, prog="tool",
                                    epilog="exit status: 0").format_help().split())
    assert "path the file to read" in text and "--out OUT.json where to write" in text
    assert "how many (100% of them) (default: 3)" in text  # % is not a format directive
    assert "the names (default: a)" in text and "the mode (default: fast when it can)" in text
    assert "--quiet (default" not in text and "where to write (default" not in text
    assert "output: --out OUT.json" in text and text.endswith("exit status: 0")
    assert "--state" not in text


def test_add_fields_to_a_group_and_duplicate_flags_refused():
    import argparse

    parser = cli.ArgumentParser(prog="tool")
    cli.add_fields(parser.add_argument_group("mine"), _ToolConfig)
    assert [g.title for g in parser._action_groups][-1] == "mine"  # "output" not nested
    assert len(parser._action_groups[-1]._group_actions) == 8
    assert len(parser._mutually_exclusive_groups) == 1
    with pytest.raises(ValueError, match="path defined by both a.path and b.path"):
        cli.tool_parser({"a": _ToolConfig, "b": _ToolConfig})
    assert isinstance(parser, argparse.ArgumentParser)
