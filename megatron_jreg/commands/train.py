"""The trainer command: `python -m megatron_jreg.train` (or under torchrun) pretrains with or
without JREG."""

import re
import sys
from typing import Dict, Optional, Sequence

from megatron_jreg.commands import flags
from megatron_jreg.commands.exit_codes import INTERRUPTED, USAGE, run_command
from megatron_jreg.config.run import BUILDERS, SECTIONS
from megatron_jreg.training.checkpoint_args import apply_checkpoint_args
from megatron_jreg.training.experiment import DESCRIPTION, ExperimentConfig


def from_argv(argv: Optional[Sequence[str]] = None) -> ExperimentConfig:
    """The run the flags (and ``--config FILE.yaml``) describe; a bad flag exits 2 with a
    one-line message."""
    given: Dict[str, dict] = {}
    read: Dict[str, object] = {}  # the checkpoint --use-checkpoint-args read, kept for the run
    sections = flags.parse(SECTIONS, argv, description=DESCRIPTION, build=BUILDERS,
                           given=given, resolve=lambda values: apply_checkpoint_args(values, read))
    try:  # the experiment's own settings (the global batch of this launch) checked as flags are
        return ExperimentConfig.from_sections(sections, given, start=read.get("start"))
    except ValueError as err:
        flags.build_parser(SECTIONS, DESCRIPTION).error(str(err))


def out_of_memory_line(err: BaseException, experiment: Optional[ExperimentConfig]) -> Optional[str]:
    """One line for an allocation the device or host refused (torch.OutOfMemoryError, the CPU
    allocator's RuntimeError, MemoryError), naming the sizes that set the memory; None for
    any other error (it keeps its traceback)."""
    text = str(err)
    if not (isinstance(err, MemoryError) or "out of memory" in text.lower()
            or "can't allocate memory" in text):
        return None
    asked = re.search(r"(?:tried|Tried) to allocate ([0-9.]+ ?[A-Za-z]*)", text)
    size = f" ({asked.group(1)} asked for)" if asked else ""
    from megatron_jreg.training.model_fit import model_fit  # torch: not before the flags

    too_big = model_fit(experiment) if experiment is not None else None
    if too_big:
        return f"out of memory{size}: {too_big.line}"
    where = ""
    if experiment is not None:
        where = (f" at --seq-length {experiment.model.seq_length}, --micro-batch-size "
                 f"{experiment.training.micro_batch_size}")
    return (f"out of memory{where}{size}; lower --seq-length or --micro-batch-size (or split "
            "each sequence over more devices with --context-parallel-size)")


def main(argv=None) -> int:
    """Parse, set up, train; the exit code (see ``training.trainer.run``; an OS error of
    writing is one line and exit 2, as in every command: ``exit_codes.run_command``)."""
    # the flags first: --help and a bad flag answer before megatron-core is imported
    # (about 3 s of imports per process)
    experiment = None
    try:
        experiment = from_argv(argv)
        from megatron_jreg.training.trainer import run

        return run_command(lambda: run(experiment))
    except (RuntimeError, MemoryError) as err:
        line = out_of_memory_line(err, experiment)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        return USAGE
    except KeyboardInterrupt:
        # Ctrl-C before the trainer's own handler is in place (imports, set-up; afterwards a
        # signal saves and exits): the lock and a --save directory this run created are gone
        # (SaveLock.release), so one line and 128 + SIGINT rather than a traceback
        if experiment is not None and not experiment.training.exit_signal_handler:
            print("interrupted; exiting without a save (the signal handler is off)",
                  file=sys.stderr, flush=True)
        else:
            print("interrupted during start-up; nothing was written", file=sys.stderr,
                  flush=True)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
