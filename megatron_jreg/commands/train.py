"""The trainer command: `python -m megatron_jreg.train` (or under torchrun) pretrains with or
without JREG."""

import sys

from megatron_jreg.training.experiment import ExperimentConfig


def main(argv=None) -> int:
    """Parse, set up, train; the exit code (see ``training.trainer.run``)."""
    # the flags first: --help and a bad flag answer before megatron-core is imported
    # (about 3 s of imports per process)
    experiment = ExperimentConfig.from_argv(argv)
    from megatron_jreg.training.trainer import run

    return run(experiment)


if __name__ == "__main__":
    sys.exit(main())
