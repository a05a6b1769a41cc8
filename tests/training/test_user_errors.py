"""The trainer's exit statuses: a user error (a setting, an input, a checkpoint) is one line
and exit 2; any other exception is a bug and keeps its traceback."""

from types import SimpleNamespace

import pytest

from megatron_jreg.checkpoint.dist_checkpoint import CheckpointError
from megatron_jreg.checkpoint.faults import TRAINER
from megatron_jreg.errors import ConfigError, InputError, UserError
from megatron_jreg.training import trainer


def _trainer_raising(exc):
    class Raising:
        closed = False
        # the flags run() phrases a checkpoint's fault with (Checkpointer.wording)
        checkpoints = SimpleNamespace(wording=TRAINER)

        def __init__(self, experiment):
            pass

        def setup(self):
            raise exc

        def train(self):
            return 0

        def close(self):
            Raising.closed = True

    return Raising


@pytest.mark.parametrize("exc", [ConfigError("--lr must be > 0, got 0"),
                                 InputError("--data-path x: no x.bin/.idx"),
                                 CheckpointError("ckpt/iter_0000004 is torn; remove it"),
                                 FileNotFoundError("tokenizer.model")])
def test_a_user_error_is_one_line_and_exit_2(exc, monkeypatch, capsys):
    fake = _trainer_raising(exc)
    monkeypatch.setattr(trainer, "Trainer", fake)
    assert trainer.run(None) == 2
    assert capsys.readouterr().err == f"error: {exc}\n"
    assert fake.closed


@pytest.mark.parametrize("exc", [ValueError("shape mismatch in a kernel"), KeyError("layer"),
                                 RuntimeError("NCCL timeout")])
def test_an_internal_error_keeps_its_traceback(exc, monkeypatch, capsys):
    fake = _trainer_raising(exc)
    monkeypatch.setattr(trainer, "Trainer", fake)
    with pytest.raises(type(exc)) as raised:
        trainer.run(None)
    assert raised.value is exc and capsys.readouterr().err == ""
    assert fake.closed  # the trainer still closes its writers


def test_every_user_error_has_one_root():
    assert issubclass(ConfigError, UserError) and issubclass(InputError, UserError)
    assert issubclass(CheckpointError, UserError)
    assert issubclass(UserError, ValueError)  # code that caught ValueError still catches it
