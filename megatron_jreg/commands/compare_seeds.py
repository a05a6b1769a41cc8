"""Is JREG better than the baseline across seeds? One-sided t-test on paired differences.

    python tools/compare_seeds.py scores.csv [--confidence 0.95] [--json out.json]
    python tools/compare_seeds.py --baseline base.json --jreg jreg.json

The input formats, the printed table and the refusal of unpaired scores (``--allow-unpaired``)
are described in docs/evaluation.md; the statistics are ``stats.seed_stats``'.
"""

import os
import sys
from dataclasses import dataclass, field

from megatron_jreg import strict_json
from megatron_jreg.atomic_write import check_output_path, write_text_atomic
from megatron_jreg.commands.exit_codes import OK, run_command
from megatron_jreg.commands.flags import ArgumentParser, tool_parser
from megatron_jreg.errors import InputError
from megatron_jreg.stats.downstream_scores import read_report_scores
from megatron_jreg.stats.seed_stats import (
    BACKENDS,
    compare_seed_scores,
    format_seed_table,
    left_out_of,
    read_seed_scores,
    resolve_backend,
)


@dataclass(kw_only=True)
class CompareSeedsConfig:
    """One comparison: a scores file and how to test it."""

    csv: str | None = field(default=None, metadata={
        "positional": True, "nargs": "?",
        "help": "per-seed scores of the baseline and JREG runs (or --baseline/--jreg)"})
    baseline: list[str] | None = field(default=None, metadata={
        "metavar": "JSON", "help": "eval_downstream --json reports of the baseline runs"})
    jreg: list[str] | None = field(default=None, metadata={
        "metavar": "JSON", "help": "eval_downstream --json reports of the JREG runs"})
    confidence: float = field(default=0.95, metadata={"help": "one-sided interval level"})
    backend: str = field(default="auto", metadata={
        "choices": BACKENDS, "default_help": "scipy if installed",
        "help": "t distribution from scipy or the built-in exact code"})
    json: str | None = field(default=None, metadata={
        "metavar": "OUT.json", "help": "also write the results as JSON"})
    allow_unpaired: bool = field(default=False, metadata={
        "help": "test the seeds both sides scored when the sides differ (refused without it), "
        "and name the seeds and tasks left out in the output and the JSON"})


def build_parser() -> ArgumentParser:
    return tool_parser({None: CompareSeedsConfig}, prog="compare_seeds",
                       description=__doc__.split("\n\n")[0])


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _compare(args), prefix="compare_seeds: error")


def _compare(args) -> int:
    if args.json:
        check_output_path(args.json, "--json")
    if not 0.0 < args.confidence < 1.0:
        raise InputError(f"--confidence {args.confidence}: must be in (0, 1), e.g. 0.95")
    resolve_backend(args.backend)  # scipy asked for but missing: say so now
    reports_given = args.baseline is not None or args.jreg is not None
    if args.csv is not None and reports_given:
        raise InputError("give a scores CSV or --baseline/--jreg reports, not both")
    if args.csv is None and not reports_given:
        raise InputError("no scores: give a CSV or --baseline JSON ... --jreg JSON ...")
    if args.csv is None and not (args.baseline and args.jreg):
        raise InputError("--baseline and --jreg go together; give both sides' reports")
    both = sorted({os.path.realpath(p) for p in args.baseline or ()}
                  & {os.path.realpath(p) for p in args.jreg or ()})
    if both:  # every difference would be 0: a test of nothing
        raise InputError(f"{both[0]} is given as both --baseline and --jreg; give each run's "
                         "report on its own side")
    source = args.csv or "the reports"
    scores = (read_seed_scores(args.csv) if args.csv
              else read_report_scores(args.baseline, args.jreg))
    try:
        results = compare_seed_scores(scores, args.confidence, args.backend,
                                      allow_unpaired=args.allow_unpaired)
    except InputError as e:  # unpaired seeds, too few seeds, an overflow: of this input
        raise InputError(f"{source}: {e}") from None
    left_out = left_out_of(scores)  # empty unless --allow-unpaired accepted it
    print("\n".join([format_seed_table(results)] + left_out.lines()))
    if args.json:
        # a p-value that does not exist (all differences 0) or an infinite t: null
        payload = {task: r.to_dict() for task, r in results}
        if left_out:
            payload["left_out"] = left_out.to_dict()
        write_text_atomic(args.json, strict_json.dumps(payload))
    return OK


if __name__ == "__main__":
    sys.exit(main())
