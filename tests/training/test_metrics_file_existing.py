"""An existing --metrics-file: one that is not JSON lines (a dataset .bin given by mistake)
is refused at start-up and left unchanged; one holding an earlier run's records is appended
to, and the start-up output says so; an empty or absent one is simply written."""

import hashlib
import types

import pytest

from megatron_jreg.errors import InputError
from megatron_jreg.training.metrics import build_metrics_logger


def _logging(path):
    return types.SimpleNamespace(metrics_file=str(path), tensorboard_dir=None,
                                 wandb_project=None)


def test_binary_file_is_refused_and_untouched(tmp_path):
    path = tmp_path / "copy.bin"
    path.write_bytes(bytes(range(256)) * 100)
    before = hashlib.md5(path.read_bytes()).hexdigest()
    with pytest.raises(InputError) as err:
        build_metrics_logger(_logging(path), 3, 0, {})
    assert "not a JSON-lines metrics file" in str(err.value) and "\n" not in str(err.value)
    assert hashlib.md5(path.read_bytes()).hexdigest() == before


def test_text_that_is_not_records_is_refused(tmp_path):
    path = tmp_path / "log.txt"
    from megatron_jreg.training.metrics import existing_metrics_file

    path.write_text('{"iteration": 1}\nsome log line\n')
    assert existing_metrics_file(str(path))[0] is not None


def test_earlier_records_are_appended_to_with_a_note(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 99, "lm_loss": 1.0}\n')
    logger = build_metrics_logger(_logging(path), 3, 0, {})
    logger.close()
    assert "appending to the" in capsys.readouterr().out


def test_absent_or_empty_file_says_nothing(tmp_path):
    from megatron_jreg.training.metrics import existing_metrics_file

    assert existing_metrics_file(str(tmp_path / "none.jsonl")) == (None, None)
    (tmp_path / "empty.jsonl").write_text("")
    assert existing_metrics_file(str(tmp_path / "empty.jsonl")) == (None, None)
