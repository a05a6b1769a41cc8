"""A trainer set up in this process from a command line, without a training step: the
objects ``Trainer.setup`` builds (tokenizer, process group, model, optimizer, schedule,
datasets, metric sinks), to read what a flag did to them.

The process group is the in-process world of one that other tests in this process may
already have started (``initialize_distributed`` keeps it). The signal handlers a setup
installs (``--exit-signal-handler``) are recorded, then this process's own are restored.

Also the trainer's boolean switches and their negations: ``NEGATIONS`` (off by default,
``--no-X`` undoes a --config file that turns them on) and ``RESTORED`` (on by default).
"""

import contextlib
import io
import signal
from types import SimpleNamespace

import yaml

# the signals the trainer may take over (SIGTERM, SIGINT and the --exit-signal choices)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


@contextlib.contextmanager
def set_up(argv):
    """Yields a namespace: ``trainer`` (set up), ``log`` (what the setup printed) and
    ``handlers`` ({signal: its handler right after the setup}). Closes the trainer after."""
    from megatron_jreg.commands.train import from_argv
    from megatron_jreg.training.trainer import Trainer

    before = {sig: signal.getsignal(sig) for sig in SIGNALS}
    trainer = Trainer(from_argv([str(a) for a in argv]))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            trainer.setup()
        handlers = {sig: signal.getsignal(sig) for sig in SIGNALS}
        yield SimpleNamespace(trainer=trainer, log=out.getvalue(), handlers=handlers,
                              before=before)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        trainer.close()


def optimizers(trainer):
    """The optimizers the trainer's (possibly chained) megatron optimizer holds."""
    return list(getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]))


# every default-off switch a --config file may turn on, and its negation; the default-on
# ones (turned off in the file) and the flag that turns each back on
NEGATIONS = {
    "--no-bf16": ("model", "bf16"), "--no-fp16": ("model", "fp16"),
    "--no-sequence-parallel": ("parallel", "sequence_parallel"),
    "--no-use-distributed-optimizer": ("optim", "use_distributed_optimizer"),
    "--no-override-opt-param-scheduler": ("optim", "override_opt_param_scheduler"),
    "--no-use-checkpoint-opt-param-scheduler": ("optim", "use_checkpoint_opt_param_scheduler"),
    "--no-calculate-per-token-loss": ("training", "calculate_per_token_loss"),
    "--no-sft": ("data", "sft"), "--no-finetune": ("checkpoint", "finetune"),
    "--no-dist-ckpt-optim-fully-reshardable": ("checkpoint", "dist_ckpt_optim_fully_reshardable"),
    "--no-ckpt-fully-parallel-load": ("checkpoint", "ckpt_fully_parallel_load"),
    "--no-async-save": ("checkpoint", "async_save"),
    "--no-use-persistent-ckpt-worker": ("checkpoint", "use_persistent_ckpt_worker"),
    "--no-allow-tokenizer-change": ("checkpoint", "allow_tokenizer_change"),
    "--no-overwrite-checkpoints": ("checkpoint", "overwrite_checkpoints"),
}
RESTORED = {"--exit-on-nan": ("training", "exit_on_nan"),
            "--exit-signal-handler": ("training", "exit_signal_handler"),
            "--ckpt-fully-parallel-save": ("checkpoint", "ckpt_fully_parallel_save")}


def negated_config(path):
    """A --config file with every switch of NEGATIONS on and of RESTORED off."""
    settings = {}
    for value, table in ((True, NEGATIONS), (False, RESTORED)):
        for section, name in table.values():
            settings.setdefault(section, {})[name] = value
    path.write_text(yaml.safe_dump(settings))
    return path
