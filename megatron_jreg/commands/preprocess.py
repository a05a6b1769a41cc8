"""Tokenise raw text into megatron-core .bin/.idx datasets (Megatron-LM's flags).

    python tools/preprocess_data.py --input DATA.jsonl --output-prefix OUT --append-eod \\
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model tok.model --workers 8

The flags are :class:`PreprocessConfig`'s fields; the work is ``data.preprocess.run_preprocess``.
Exit status: 0 ok, 2 a user error, 130 Ctrl-C, 143 SIGTERM (partial outputs removed on both).
"""

from __future__ import annotations

import signal
import sys

from megatron_jreg.commands.exit_codes import INTERRUPTED, OK, TERMINATED, run_command
from megatron_jreg.commands.flags import ArgumentParser, tool_parser, tool_values
from megatron_jreg.data.preprocess.config import PreprocessConfig, Terminated
from megatron_jreg.data.preprocess.pipeline import _raise_terminated, run_preprocess
from megatron_jreg.data.preprocess.sft_files import metadata_path

DESCRIPTION = ("Tokenise raw text into megatron-core .bin/.idx datasets; with --sft, chat "
               "conversations into tokens and a loss mask.")


def build_parser() -> ArgumentParser:
    """The flags of ``PreprocessConfig``'s fields (``megatron_jreg.commands.flags.tool_parser``)."""
    return tool_parser({None: PreprocessConfig}, description=DESCRIPTION)


def config_from_args(argv: list[str] | None = None) -> PreprocessConfig:
    """Raises ``PreprocessError`` for a bad value; bad flags exit 2 from argparse."""
    values = tool_values({None: PreprocessConfig}, argv, description=DESCRIPTION)
    return PreprocessConfig(**values[None])


def main(argv: list[str] | None = None) -> int:
    """Returns the exit code (0 ok, 2 user error, 130 Ctrl-C, 143 SIGTERM)."""
    return run_command(lambda: _preprocess(argv))


def _preprocess(argv: list[str] | None) -> int:
    config = config_from_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        stats = run_preprocess(config)
    except KeyboardInterrupt:
        print("interrupted: partial outputs removed", file=sys.stderr)
        return INTERRUPTED
    except Terminated:
        print("terminated: partial outputs removed", file=sys.stderr)
        return TERMINATED
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(stats.summary())
    for prefix in config.output_prefixes():
        print(f"wrote {prefix}.bin and {prefix}.idx")
    if config.sft:
        print(f"wrote {metadata_path(config.output_prefixes()[0])}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
