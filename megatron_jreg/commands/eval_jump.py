"""``tools/eval_jump.py``: parse, build the sources, measure, write.

    python tools/eval_jump.py --hf-model DIR --text-file eval.txt --json out.json
    python tools/eval_jump.py --load CKPT --all-iterations --text-file eval.txt --plot traj.png

The models come from ``analysis.hf_source`` (``--hf-model``) or ``analysis.checkpoint_source``
(``--load``), one kind per run; the report format and the exit statuses are in
docs/evaluation.md and ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import sys
from typing import List, Optional, Sequence, Tuple

from megatron_jreg import strict_json
from megatron_jreg.analysis.compare import compare_reports, format_summary_table, load_report
from megatron_jreg.analysis.jump_accumulator import JumpReport, reports_to_csv
from megatron_jreg.analysis.source_flags import (
    CheckpointSourceFlags,
    HFSourceFlags,
    layout_flags_given,
)
from megatron_jreg.analysis.sources import SourceEntry
from megatron_jreg.analysis.text_inputs import read_documents, token_sequences
from megatron_jreg.analysis.trajectory import (
    format_trajectory_table,
    sort_trajectory,
    trajectory_to_csv,
)
from megatron_jreg.atomic_write import check_output_path, write_text_atomic
from megatron_jreg.checkpoint.faults import TOOLS
from megatron_jreg.commands.exit_codes import NONFINITE, OK, run_command
from megatron_jreg.commands.flags import add_fields, tool_parser
from megatron_jreg.config.schema import setting
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import output_locks

PROG = "eval_jump"
EXIT_NONFINITE = NONFINITE  # as the trainer exits on a NaN loss

EPILOG = (
    "exit status: 0 on success; 2 for bad input (one line on stderr naming it); "
    f"{EXIT_NONFINITE} when a measured model's hidden states are not finite: the tables, "
    "--json, --csv and --plot are still written (nan in tables and CSV, null in JSON, gaps in "
    "plots), then one line on stderr names the model and its layers"
)


@dataclasses.dataclass(kw_only=True)
class ModelRunFlags:
    """How to run the measured models."""

    include_final_norm: bool = setting(
        False, help="apply the model's final norm to h_L (what HF output_hidden_states "
        "reports); by default h_L is taken before it")
    device: str = setting("cpu", help="torch device for the model")
    dtype: str = setting("float32", choices=["float32", "bfloat16", "float16"],
                       help="weights' dtype; the cosine is always computed in fp32")
    label: Optional[List[str]] = setting(
        action="append", metavar="NAME",
        help="the name of a measured model in tables and plots; once per model, in order")


@dataclasses.dataclass(kw_only=True)
class TextFlags:
    """The evaluation text: one of --text-file, --jsonl, --data-path."""

    text_file: Optional[str] = setting(
        help="plain text, one document per line (blank lines skipped)")
    jsonl: Optional[str] = setting(help="JSON lines, the document under --json-key")
    json_key: str = setting("text", help="the JSONL key holding the text")
    data_path: Optional[str] = setting(
        metavar="PREFIX", help="a Megatron indexed dataset (PREFIX.bin/.idx), already tokenized")
    seq_length: int = setting(2048, help="each document is cut to this many tokens")
    max_tokens: Optional[int] = setting(help="stop after this many counted tokens")
    batch_size: int = setting(8, help="documents per forward pass; results do not depend on it")


@dataclasses.dataclass(kw_only=True)
class OutputFlags:
    """Reports read and written."""

    reports: List[str] = dataclasses.field(default_factory=list, metadata={
        "metavar": "JSON",
        "help": "reports written earlier by --json, shown and plotted with the measured ones"})
    compare: Optional[List[str]] = setting(
        nargs="*", metavar="JSON",
        help="Delta_l = Psi_l(B) - Psi_l(A): give two report files A B, or no file to compare "
        "the two models of this run (first is A)")
    json: Optional[str] = setting(
        metavar="OUT.json", help="write the report (a list when there are several)")
    csv: Optional[str] = setting(
        metavar="OUT.csv", help="write model,layer,displacement,jump_rate rows")
    plot: Optional[str] = setting(
        metavar="OUT.png", help="plot Psi_l per layer, every model on one plot")
    title: Optional[str] = setting(help="title of the plot")
    no_progress: bool = setting(False, help="no progress bar on stderr")


FLAG_GROUPS = {"how to run the model": ModelRunFlags, "evaluation text (one of)": TextFlags,
               "reports and outputs": OutputFlags}


def build_parser() -> argparse.ArgumentParser:
    parser = tool_parser(
        {},
        prog=PROG,
        description="Measure the per-layer displacement Psi_l and the jump rates zeta of a model "
        "(Shibata et al., EACL 2026). See docs/evaluation.md.",
        epilog=EPILOG,
    )
    group = parser.add_argument_group("model to measure (one kind)")
    add_fields(group, HFSourceFlags)
    add_fields(group, CheckpointSourceFlags)
    for title, cls in FLAG_GROUPS.items():
        add_fields(parser.add_argument_group(title), cls)
    return parser


def _flags_of(args: argparse.Namespace, cls: type):
    """The dataclass ``cls`` holding its fields' parsed values."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def model_entries(args: argparse.Namespace) -> List[SourceEntry]:
    """The models the parsed values ask for: none, or those of exactly one kind, named by
    ``--label`` when it is given."""
    given = [flag for flag, value in (("--hf-model", args.hf_model), ("--load", args.load))
             if value]
    if len(given) > 1:
        raise InputError(
            f"{' and '.join(given)} were both given; measure one kind of model per run")
    run = {"include_final_norm": args.include_final_norm, "device": args.device,
           "dtype": args.dtype}
    # the model code after the flags: --help and a bad flag answer before it loads
    from megatron_jreg.analysis import checkpoint_source, hf_source

    if args.hf_model:
        entries = hf_source.hf_entries(_flags_of(args, HFSourceFlags), **run)
    elif args.load:
        entries = checkpoint_source.checkpoint_entries(_flags_of(args, CheckpointSourceFlags),
                                                       **run)
    else:
        return []
    labels = args.label or []
    if labels:
        if len(labels) != len(entries):
            raise InputError(
                f"--label was given {len(labels)} times for {len(entries)} models; "
                "give one --label per model, in order"
            )
        for entry, label in zip(entries, labels):
            entry.label = label
    return entries


def _check_args(args: argparse.Namespace, entries: List[SourceEntry]) -> List[str]:
    """Validate what can be validated before loading a model; return the report files to read."""
    for flag, path in (("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)):
        if path:
            check_output_path(path, flag)
    for flag, value in (
        ("--seq-length", args.seq_length),
        ("--batch-size", args.batch_size),
        ("--max-tokens", args.max_tokens),
    ):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    layout_flags = layout_flags_given(args)
    if layout_flags and not getattr(args, "load", None):
        verb = "applies" if len(layout_flags) == 1 else "apply"
        raise InputError(f"{' and '.join(layout_flags)} only {verb} to --load CKPT")
    report_files = list(args.reports)
    if args.compare is not None:
        if len(args.compare) not in (0, 2):
            raise InputError(
                f"--compare takes two report files A B or none, got {len(args.compare)}"
            )
        report_files += args.compare
    has_text = any((args.text_file, args.jsonl, args.data_path))
    if entries:
        # Reading is lazy, but the paths are checked now, before any model loads, and so
        # is that there is a document at all (loading a model takes much longer).
        documents = read_documents(args.text_file, args.jsonl, args.json_key, args.data_path)
        if args.data_path is None:
            # Text is decoded and parsed through once now, so that a bad line (a binary
            # file, broken JSON) fails here. --max-tokens N uses at most N documents (each
            # gives a token, unless it tokenizes to nothing): the rest is not read.
            empty = sum(1 for _ in itertools.islice(documents, args.max_tokens)) == 0
        else:  # already tokenized ids, checked against the vocabulary as they are read
            empty = next(documents, None) is None
        if empty:
            raise InputError(
                "no tokens to evaluate: the input is empty after skipping blank documents; "
                "check --text-file/--jsonl/--data-path"
            )
    elif has_text:
        raise InputError(
            "evaluation text was given but no model to measure; add --hf-model DIR or --load CKPT"
        )
    elif not report_files:
        raise InputError(
            "nothing to measure: give --hf-model DIR or --load CKPT, and --text-file FILE; "
            "or --compare A.json B.json"
        )
    return report_files


def _is_output_rank() -> bool:
    """Under torchrun only global rank 0 prints and writes; the others stay quiet."""
    return int(os.environ.get("RANK", "0")) == 0


def _measure(entry: SourceEntry, args: argparse.Namespace) -> JumpReport:
    from megatron_jreg.analysis.measure import measure_jump

    source = entry.open()
    sequences = token_sequences(
        read_documents(args.text_file, args.jsonl, args.json_key, args.data_path),
        source.tokenize,
        args.seq_length,
        args.max_tokens,
        source.vocab_size,
    )
    extra = {"source": entry.describe, "seq_length": args.seq_length, "dtype": args.dtype}
    # where the weights ran: the --device given, or accelerate's --device-map in its place
    device_map = getattr(args, "device_map", None)
    if device_map:
        extra["device_map"] = device_map
    else:
        extra["device"] = args.device
    if entry.iteration is not None:
        extra["iteration"] = entry.iteration
    extra.update(entry.extra)
    return measure_jump(
        source,
        sequences,
        batch_size=args.batch_size,
        label=entry.label,
        max_tokens=args.max_tokens,
        progress=not args.no_progress and _is_output_rank(),
        extra=extra,
        world=entry.world(),  # asked after open(): a torchrun world is set up by then
    )


def _layer_list(layers: Sequence[int]) -> str:
    """[1, 2, 3, 5] -> "1-3, 5"."""
    runs: List[List[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def nonfinite_message(measured: Sequence[Tuple[SourceEntry, JumpReport]]) -> str:
    """One line naming each measured model with a non-finite Psi_l and its layers; "" if none.

    Psi_l is not finite exactly when the layer's input h_{l-1} or output h_l holds a NaN
    or inf on a counted token.
    """
    found = []
    for entry, report in measured:
        layers = [l for l, p in enumerate(report.displacement, start=1) if not math.isfinite(p)]
        if layers:
            where = f" ({entry.describe})" if entry.describe else ""
            found.append(
                f"{report.model}{where} at layer{'s' if len(layers) > 1 else ''} "
                f"{_layer_list(layers)} of {report.num_layers}"
            )
    if not found:
        return ""
    return (
        f"non-finite hidden states (NaN/inf) in {'; '.join(found)}: Psi_l and the zeta they "
        "enter are NaN, shown as nan (null in --json); the weights hold NaN/inf or the "
        "activations overflow, so check the model (an earlier checkpoint, or --dtype float32)"
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "device_map", None) and not getattr(args, "hf_model", None):
        raise InputError(f"--device-map {args.device_map} applies to --hf-model only; a --load "
                         "checkpoint too large for one device runs under torchrun with "
                         "--tensor-model-parallel-size/--pipeline-model-parallel-size")
    entries = model_entries(args)
    output = _is_output_rank()

    def show(text: str) -> None:
        if output:
            print(text, end="\n\n", flush=True)

    report_files = _check_args(args, entries)
    loaded = [load_report(path) for path in report_files]

    measured: List[Tuple[SourceEntry, JumpReport]] = []
    for entry in entries:
        report = _measure(entry, args)
        measured.append((entry, report))
        show(report.format_table())
    for report in loaded:
        show(report.format_table())
    reports = [r for _, r in measured] + loaded

    if args.compare is not None:
        pair = loaded[-2:] if args.compare else reports
        if len(pair) != 2:
            raise InputError(
                f"--compare without files needs exactly two models in the run, got {len(pair)}"
            )
        show(compare_reports(pair[0], pair[1]).format_table())

    trajectory = sort_trajectory([(e.iteration, r) for e, r in measured if e.iteration is not None])
    if len(trajectory) > 1:
        show(format_trajectory_table(trajectory))
    elif len(reports) > 1:
        show(format_summary_table(reports))

    # every rank holds the same reports, so the status is the same everywhere; the outputs
    # are written first (with NaN as nan/null), then the problem is reported
    problem = nonfinite_message(measured)
    status = EXIT_NONFINITE if problem else OK
    if not output:
        return status
    if args.json:
        payload = reports[0].to_dict() if len(reports) == 1 else [r.to_dict() for r in reports]
        write_text_atomic(args.json, strict_json.dumps(payload))  # NaN as null
    if args.csv:
        write_text_atomic(
            args.csv,
            trajectory_to_csv(trajectory) if len(trajectory) > 1 else reports_to_csv(reports),
        )
    if args.plot:
        from megatron_jreg.analysis import plots

        if len(trajectory) > 1:
            plots.plot_trajectory(trajectory, args.plot, title=args.title)
        else:
            plots.plot_displacement(reports, args.plot, title=args.title)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr, flush=True)
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    # one writer per report: held from before the first model loads until the files are in
    outputs = [("--json", args.json), ("--csv", args.csv), ("--plot", args.plot)]

    def measure() -> int:
        with output_locks(outputs if _is_output_rank() else []):
            return run(args)

    # every rank meets the same input error; say it once
    return run_command(measure, prefix=f"{PROG}: error", say=_is_output_rank(), wording=TOOLS)


if __name__ == "__main__":
    sys.exit(main())
