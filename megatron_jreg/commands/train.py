"""The trainer command: `python -m megatron_jreg.train` (or under torchrun) pretrains with or
without JREG."""

import sys
from typing import Dict, Optional, Sequence

from megatron_jreg.commands import flags
from megatron_jreg.commands.exit_codes import run_command
from megatron_jreg.config.run import BUILDERS, SECTIONS
from megatron_jreg.training.checkpoint_args import apply_checkpoint_args
from megatron_jreg.training.experiment import DESCRIPTION, ExperimentConfig


def from_argv(argv: Optional[Sequence[str]] = None) -> ExperimentConfig:
    """The run the flags (and ``--config FILE.yaml``) describe; a bad flag exits 2 with a
    one-line message."""
    given: Dict[str, dict] = {}
    sections = flags.parse(SECTIONS, argv, description=DESCRIPTION, build=BUILDERS,
                           given=given, resolve=apply_checkpoint_args)
    return ExperimentConfig.from_sections(sections, given)


def main(argv=None) -> int:
    """Parse, set up, train; the exit code (see ``training.trainer.run``; an OS error of
    writing is one line and exit 2, as in every command: ``exit_codes.run_command``)."""
    # the flags first: --help and a bad flag answer before megatron-core is imported
    # (about 3 s of imports per process)
    experiment = from_argv(argv)
    from megatron_jreg.training.trainer import run

    return run_command(lambda: run(experiment))


if __name__ == "__main__":
    sys.exit(main())
