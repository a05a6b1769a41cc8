"""Downstream accuracy (the paper's Table 3) through lm-evaluation-harness, offline-capable.

    python tools/eval_downstream.py --load runs/jreg-s1/ckpt runs/jreg-s2/ckpt --tasks paper \
        --json jreg.json
    python tools/eval_downstream.py --hf-model DIR --tasks boolq,piqa --include-path tasks/

Options, metrics and the report: ``--help`` and docs/evaluation.md. The flags are the fields
of :class:`DownstreamConfig`; the work is :mod:`megatron_jreg.downstream.evaluate`.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from megatron_jreg import strict_json
from megatron_jreg.atomic_write import stop_reason, write_text_atomic
from megatron_jreg.checkpoint.faults import TOOLS
from megatron_jreg.commands.exit_codes import INTERRUPTED, OK, run_command
from megatron_jreg.commands.flags import ArgumentParser, tool_parser, tool_values
from megatron_jreg.downstream.report import format_table, to_csv
from megatron_jreg.downstream.settings import PROG, DownstreamConfig
from megatron_jreg.writer_lock import output_locks

DESCRIPTION = ("Downstream accuracy (the paper's Table 3) of checkpoints or HF models through "
               "lm-evaluation-harness. See docs/evaluation.md.")


def build_parser() -> ArgumentParser:
    return tool_parser({None: DownstreamConfig}, prog=PROG, description=DESCRIPTION)


def main(argv: Optional[Sequence[str]] = None) -> int:
    values = tool_values({None: DownstreamConfig}, argv, prog=PROG, description=DESCRIPTION)
    config = DownstreamConfig(**values[None])
    return run_command(lambda: _evaluate(config), prefix=f"{PROG}: error", wording=TOOLS)


def _evaluate(config: DownstreamConfig) -> int:
    # the work after the flags: --help and a bad flag answer before the model code loads
    from megatron_jreg.downstream.evaluate import _signals_as_interrupt_here, run

    try:  # a kill removes the temporary export on the way out, as Ctrl-C does
        with _signals_as_interrupt_here(), output_locks([("--json", config.json),
                                                         ("--csv", config.csv)]):
            reports = run(config)  # one writer per report, from before the first model
            print(format_table(reports))
            if config.json:
                payload = (reports[0].to_dict() if len(reports) == 1
                           else [r.to_dict() for r in reports])
                write_text_atomic(config.json, strict_json.dumps(payload))
            if config.csv:
                write_text_atomic(config.csv, to_csv(reports))
    except KeyboardInterrupt as stopped:
        print(f"{PROG}: stopped ({stop_reason(stopped)}); temporary files removed, no report "
              "written", file=sys.stderr)
        return INTERRUPTED
    return OK


if __name__ == "__main__":
    sys.exit(main())
