"""--config YAML keys may be the flags' own names: ``jreg_lambda`` or ``jreg-lambda`` sets
jreg.lam as ``lam`` does (and is checked the same way); the two spellings together are set
twice; an inverted switch's name (``disable_bias_linear``) is refused with the real key."""

import pytest

from megatron_jreg.config.run import SECTIONS
from megatron_jreg.config.yaml_settings import from_yaml
from megatron_jreg.errors import ConfigError


def _load(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return from_yaml(str(path), SECTIONS)


@pytest.mark.parametrize("key", ["jreg_lambda", "jreg-lambda", "lam"])
def test_flag_name_sets_the_field(tmp_path, key):
    assert _load(tmp_path, f"{key}: 0.5\njreg-alpha: 2\n")["jreg"] == {"lam": 0.5, "alpha": 2.0}


def test_flag_name_value_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="jreg_lambda must be a finite number >= 0, got nan"):
        _load(tmp_path, "jreg_lambda: .nan\n")


def test_both_spellings_are_set_twice(tmp_path):
    with pytest.raises(ConfigError, match="set twice"):
        _load(tmp_path, "jreg_lambda: 1\nlam: 2\n")


def test_inverted_switch_names_the_real_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "disable_bias_linear: true\n")
    assert "add_bias_linear: false" in str(err.value)
