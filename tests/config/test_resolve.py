"""``config.resolve``: every derived value of a run, computed once from the settings and
the facts, as new frozen objects; the settings given are left as they were."""

import dataclasses
from types import SimpleNamespace

import pytest

from megatron_jreg.commands.train import from_argv
from megatron_jreg.config.resolve import RunFacts, kept_schedule, resolve
from megatron_jreg.config.run import OptimConfig
from megatron_jreg.errors import ConfigError

FACTS = RunFacts(tokenizer_vocab_size=259, tokenizer_identity="abc", transformer_impl="local")


def parsed(*argv):
    return from_argv(["--data-path", "x", "--model-preset", "tiny", *argv])


def test_resolving_twice_gives_the_same_run_and_leaves_the_settings_alone():
    raw = parsed("--sequence-parallel", "--transformer-impl", "auto")
    before = raw.to_yaml()
    run = resolve(raw, FACTS)
    assert resolve(raw, FACTS) == run
    assert raw.to_yaml() == before
    assert resolve(run, FACTS) == run  # a resolved run resolves to itself


def test_derived_values():
    run = resolve(parsed("--sequence-parallel", "--transformer-impl", "auto"), FACTS)
    assert (run.model.vocab_size, run.model.padded_vocab) == (259, 384)  # up to 128
    assert run.model.transformer_impl == "local"
    assert run.parallel.sequence_parallel is False  # off at TP 1, as in Megatron-LM
    assert run.data.tokenizer_identity == "abc"
    tp2 = resolve(parsed("--sequence-parallel", "--tensor-model-parallel-size", "2"), FACTS)
    assert tp2.parallel.sequence_parallel is True
    assert resolve(parsed("--vocab-size", "300"), FACTS).model.vocab_size == 300
    null = parsed("--tokenizer-type", "NullTokenizer", "--vocab-size", "300")
    assert resolve(null, RunFacts(tokenizer_vocab_size=301)).model.vocab_size == 301


def test_sections_are_frozen():
    run = resolve(parsed(), FACTS)
    for section in ("parallel", "jreg", "training", "checkpoint", "logging", "megatron_lm"):
        name = dataclasses.fields(getattr(run, section))[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(run, section), name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model = None


def test_a_checkpoints_embedding_rows_are_kept_or_refused():
    facts = dataclasses.replace(FACTS, checkpoint="--load ckpt", saved_embedding_rows=512)
    assert resolve(parsed(), facts).model.padded_vocab == 512
    with pytest.raises(ConfigError, match="--load ckpt: the saved embedding has 256 rows, "
                                          "fewer than the tokenizer's 259"):
        resolve(parsed(), dataclasses.replace(facts, saved_embedding_rows=256))
    with pytest.raises(ConfigError, match="not divisible by --tensor-model-parallel-size 2"):
        resolve(parsed("--tensor-model-parallel-size", "2"),
                dataclasses.replace(facts, saved_embedding_rows=511))


def test_kept_schedule_is_the_schedule_the_scheduler_keeps():
    """The resolved schedule equals what OptimConfig.keep_schedule takes from a scheduler
    holding the same values."""
    state = dict(max_lr=1e-3, min_lr=0.0, lr_decay_style="cosine", start_wd=0.1,
                 lr_warmup_steps=10.01, lr_decay_steps=1000, wsd_decay_steps=None,
                 lr_wsd_decay_style=None)
    o = OptimConfig(lr_warmup_fraction=0.01)
    o.keep_schedule(SimpleNamespace(**state), 8)
    raw = parsed("--lr-warmup-fraction", "0.01", "--global-batch-size", "8")
    run = resolve(raw, dataclasses.replace(FACTS, saved_schedule=state))
    assert run.optim == dataclasses.replace(o, **{k: getattr(raw.optim, k) for k in (
        "override_opt_param_scheduler", "use_checkpoint_opt_param_scheduler")})
    assert kept_schedule(state, 8)["lr_warmup_samples"] == 10
