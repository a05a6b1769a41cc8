"""The model presets are read without a parser (``config.schema.read_flags``), exactly as
the trainer's command line reads the same flags."""

import pytest

from megatron_jreg.commands.flags import build_parser
from megatron_jreg.config.model import PRESETS, ModelConfig
from megatron_jreg.config.presets import MEGATRON_LM_MODEL_DEFAULTS, PRESET_FLAGS, preset_flags


@pytest.mark.parametrize("preset", sorted(PRESET_FLAGS))
def test_preset_bundle_is_what_the_command_line_reads(preset):
    parsed = vars(build_parser({"model": ModelConfig}).parse_args(preset_flags(preset)))
    given = {dest.split(".", 1)[1]: value for dest, value in parsed.items()}
    assert PRESETS[preset] == {**MEGATRON_LM_MODEL_DEFAULTS, **given}


def test_presets_are_built_without_a_parser():
    """Importing the model config parses no command line (a fresh interpreter in which
    any argparse parse fails)."""
    import subprocess
    import sys

    code = ("import argparse\n"
            "def refuse(*a, **k): raise AssertionError('a command line was parsed')\n"
            "argparse.ArgumentParser.parse_known_args = refuse\n"
            "from megatron_jreg.config.model import PRESETS\n"
            "print(sorted(PRESETS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
