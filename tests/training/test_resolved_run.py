"""The run config a checkpoint records (``run_config.yaml``) is exactly the resolved run
(``config.resolve``) of the same command line: a fresh run, and a resumed one that keeps
its checkpoint's schedule and embedding rows."""

from trainer_runs import base_args, train

from megatron_jreg.checkpoint import formats
from megatron_jreg.commands.train import from_argv
from megatron_jreg.config.model import resolve_transformer_impl
from megatron_jreg.config.resolve import RunFacts, resolve
from megatron_jreg.data.tokenizers.build import build_tokenizer, tokenizer_identity
from megatron_jreg.training.checkpointing import Checkpointer
from megatron_jreg.training.experiment import ExperimentConfig
from megatron_jreg.training.source import starting_point


def resolved(argv):
    """``resolve`` of ``argv``, with the facts gathered as the trainer gathers them."""
    raw = from_argv(argv)
    tokenizer = build_tokenizer(raw.data.tokenizer_type, raw.data.tokenizer_model)
    facts = RunFacts(tokenizer_vocab_size=tokenizer.vocab_size,
                     tokenizer_identity=tokenizer_identity(tokenizer),
                     transformer_impl=resolve_transformer_impl(raw.model.transformer_impl)[0],
                     **Checkpointer(raw, starting_point(raw.checkpoint, raw.start)).facts())
    return resolve(raw, facts)


def test_saved_run_config_is_the_resolved_run(demo_data, tmp_path):
    first = tmp_path / "first"
    argv = base_args(demo_data, train_iters=2, lr_decay_iters=8, save=first,
                     sequence_parallel=True)
    train(argv)
    saved = formats.read(str(first), 2).opened.read_text("run_config.yaml")
    run = resolved(argv)
    assert saved == run.to_yaml()
    assert ExperimentConfig.from_yaml(saved) == run
    assert run.parallel.sequence_parallel is False  # resolved, and recorded so

    # a resume that keeps the checkpoint's schedule (another --lr is ignored)
    second = tmp_path / "second"
    argv = base_args(demo_data, train_iters=3, lr_decay_iters=8, load=first, save=second,
                     lr=1e-3, **{"use-checkpoint-opt-param-scheduler": True})
    train(argv)
    saved = formats.read(str(second), 3).opened.read_text("run_config.yaml")
    run = resolved(argv)
    assert saved == run.to_yaml()
    assert run.optim.lr == 3e-3 and run.model.padded_vocab == 384
