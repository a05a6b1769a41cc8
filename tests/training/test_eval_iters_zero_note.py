"""--eval-iters 0 with an --eval-interval given: the start-up lines say that no validation
runs (it used to be silent); without --eval-interval given, or with batches to validate,
nothing is said."""

from megatron_jreg.commands.train import from_argv
from megatron_jreg.config.megatron_lm import notes

BASE = ["--model-preset", "tiny", "--data-path", "x", "--tokenizer-type", "ByteTokenizer"]


def _lines(*flags):
    experiment = from_argv(BASE + list(flags))
    return [line for line in notes(experiment, experiment.given, "local", "gloo")
            if "--eval-" in line]


def test_eval_iters_zero_with_an_interval_is_said():
    assert _lines("--eval-iters", "0", "--eval-interval", "1") == [
        "--eval-interval 1: no validation with --eval-iters 0 (pass --eval-iters 1 or more "
        "to validate)"]


def test_no_line_otherwise():
    assert _lines("--eval-iters", "0") == []
    assert _lines("--eval-iters", "2", "--eval-interval", "1") == []
    assert _lines("--eval-iters", "0", "--eval-interval", "0") == []
