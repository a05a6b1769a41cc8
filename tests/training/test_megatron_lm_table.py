"""Every row of the Megatron-LM flags table (``megatron_lm.TABLE``), given to the trainer's
entry point: an accepted flag sets its own setting and nothing else, a flag accepted with a
printed line also gets that line among the start-up lines, and a refused flag stops the
run with exit status 2 and one line naming it. The cases are the table's rows, so a row is
checked from the day it is added; its value comes from the row's own type, choices and
bounds."""

import os
import sys
import types

import pytest
from trainer_runs import REPO

from megatron_jreg import train
from megatron_jreg.commands import flags as cli
from megatron_jreg.config import megatron_lm
from megatron_jreg.config.megatron_lm import ACCEPTED, NOTED, REFUSED, TABLE
from megatron_jreg.config.run import SECTIONS

BASE = ["--data-path", "x"]
DOC = os.path.join(REPO, "docs", "megatron_lm_flags.md")


def example(row):
    """A value of the row's flag that is neither its default nor one it takes silently."""
    if row.kind is bool:
        return True  # the switch
    assert row.nargs is None, f"{row.flag}: teach example() a value for nargs={row.nargs}"
    if row.choices:
        values = [c for c in row.choices if c != row.default and c not in row.allowed]
        assert values, f"{row.flag}: every choice is its default or taken silently"
        return values[0]
    if row.kind is str:
        return "other"
    assert row.kind in (int, float), f"{row.flag}: teach example() a {row.kind.__name__} value"
    bounds = row.bounds or {}
    start = row.default if row.default is not None else bounds.get("min", bounds.get("gt", 0))
    value = row.kind(start + 1)
    while value in row.allowed:
        value += 1
    assert (value >= bounds.get("min", value) and value > bounds.get("gt", value - 1)
            and value <= bounds.get("max", value) and value < bounds.get("lt", value + 1)), row.flag
    return value


def flag_argv(row, value):
    return [row.flag] if row.kind is bool else [row.flag, str(value)]


def named(row, value):
    """The flag as the trainer's lines name it: with its value unless a switch."""
    return row.flag if row.kind is bool else f"{row.flag} {value}"


@pytest.fixture
def start(monkeypatch):
    """``train.main`` on BASE + argv up to the trainer: the experiment it hands to the
    trainer's ``run`` (replaced here, so nothing trains); a refused flag exits first."""
    handed = []
    trainer = types.ModuleType("megatron_jreg.training.trainer")
    trainer.run = lambda experiment: handed.append(experiment) or 0
    monkeypatch.setitem(sys.modules, trainer.__name__, trainer)

    def start(argv):
        assert train.main(BASE + argv) == 0 and len(handed) == 1
        return handed.pop()

    return start


def startup_lines(experiment, backend):
    """The Megatron-LM lines the trainer prints at start-up (trainer.Trainer.setup)."""
    return megatron_lm.notes(experiment, experiment.given, "local", backend)


def check_accepted(row, value, start, said):
    """The flag sets megatron_lm.<its name> to the value and leaves every other setting as
    the run without it has them; the start-up lines are ``said(backend)``."""
    name = row.flag.lstrip("-").replace("-", "_")
    without, run = start([]), start(flag_argv(row, value))
    expected = without.to_dict()
    assert name in expected["megatron_lm"]
    expected["megatron_lm"][name] = value
    assert run.to_dict() == expected
    assert type(getattr(run.megatron_lm, name)) is type(value)
    for backend in ("nccl", "gloo"):
        assert startup_lines(without, backend) == []
        assert startup_lines(run, backend) == said(backend), backend


@pytest.mark.parametrize("row", TABLE, ids=[row.flag for row in TABLE])
def test_table_row_does_what_the_table_says(row, start, capsys):
    """The row as the docs show it; then its flag given a value: refused in one line
    (exit status 2), or accepted as its own setting with its line if it has one."""
    assert row.status in (ACCEPTED, NOTED, REFUSED), row.status
    documented = f"| `{row.flag}` | {row.status} | {row.why} |"
    assert documented in open(DOC).read(), f"docs/megatron_lm_flags.md lacks {documented}"
    value = example(row)
    if row.status == REFUSED:
        with pytest.raises(SystemExit) as exc:
            start(flag_argv(row, value))
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.count("\n") == 1 and "usage" not in err, err
        assert f"{named(row, value)}: not supported: {row.why}" in err, err
        return
    line = f"{named(row, value)}: {row.why}"

    def said(backend):
        if row.status == ACCEPTED:
            return []
        # the row of --distributed-backend: a line only when it names another backend
        # than the run's (the trainer's backend follows the device)
        if row.flag == "--distributed-backend" and value == backend:
            return []
        return [line]

    check_accepted(row, value, start, said)


SILENT = [(row, value) for row in TABLE for value in row.allowed]


@pytest.mark.parametrize("row, value", SILENT, ids=[f"{r.flag} {v}" for r, v in SILENT])
def test_values_a_row_allows_are_taken_silently(row, value, start):
    """A refused or noted flag given one of its allowed values (Megatron-LM's default, what
    happens here anyway) is accepted with no line."""
    assert row.status != ACCEPTED
    check_accepted(row, value, start, lambda backend: [])


def test_section_flags_are_trainer_flags_and_documented():
    """The flags with a setting of their own are the trainer's flags, none also a table row,
    and the docs name each."""
    known = set(cli.build_parser(SECTIONS)._option_string_actions)
    listed = [row.flag for row in TABLE] + [f for flags in megatron_lm.SECTION_FLAGS.values()
                                            for f in flags]
    assert len(listed) == len(set(listed))
    doc = open(DOC).read()
    for flags in megatron_lm.SECTION_FLAGS.values():
        for flag in flags:
            assert flag in known and f"`{flag}`" in doc, flag



def test_start_up_lines_in_table_order_then_the_others(start):
    """The table's lines in the table's order (not the command line's), then those about
    flags with a setting of their own, then the vocabulary padding when Megatron-LM's would
    differ (50257 rows: up to a multiple of 128 here, of 128 * 8 at TP 8 in Megatron-LM)."""
    exp = start(["--num-layers", "4", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights",
                 "--disable-bias-linear", "--num-query-groups", "2", "--sequence-parallel",
                 "--attention-backend", "flash", "--timing-log-level", "2",
                 "--distributed-backend", "nccl", "--tensor-model-parallel-size", "1",
                 "--log-throughput"])
    exp.model.vocab_size = 259  # the trainer's tokenizer sets it
    assert [line.split(":")[0] for line in startup_lines(exp, "gloo")] == [
        "--distributed-backend nccl", "--timing-log-level 2", "--sequence-parallel",
        "--num-query-groups 2"]
    tp8 = start(["--vocab-size", "50257", "--tensor-model-parallel-size", "8"])
    [line] = startup_lines(tp8, "nccl")
    assert "padded to 50304 rows" in line and "Megatron-LM pads to 51200 at TP 8" in line
