"""Export a checkpoint of our trainer to a Hugging Face directory of its model family.

    python tools/convert_to_hf.py --load CKPT [--iteration N] --output DIR

Any TP/PP layout is read on one process. The mapping and the checks live in
``megatron_jreg.checkpoint.to_hf``; usage with lm_eval: docs/evaluation.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatron_jreg.atomic_write import signals_as_interrupt, stop_reason
from megatron_jreg.checkpoint.faults import TOOLS
from megatron_jreg.commands.exit_codes import INTERRUPTED, OK, run_command
from megatron_jreg.commands.flags import ArgumentParser, tool_parser
from megatron_jreg.hf_models import DTYPE_NAMES

PROG = "convert_to_hf"


@dataclass(kw_only=True)
class ExportConfig:
    """The flags of ``convert_to_hf``; ``main`` hands them to ``to_hf.convert``."""

    load: str = field(metadata={"metavar": "CKPT", "help": "the run's --save directory"})
    iteration: Optional[int] = field(default=None, metadata={
        "metavar": "N", "default_help": "the latest", "help": "the iteration to export"})
    output: str = field(metadata={"metavar": "DIR", "help": "a new directory to write"})
    dtype: str = field(default="float32", metadata={
        "choices": sorted(DTYPE_NAMES), "help": "dtype of the saved weights"})
    tokenizer_model: Optional[str] = field(default=None, metadata={
        "metavar": "PATH", "help": "the run's tokenizer file, when it moved since training"})
    no_tokenizer: bool = field(default=False, metadata={
        "help": "write the model only, no tokenizer files"})


def build_parser() -> ArgumentParser:
    return tool_parser(
        {None: ExportConfig},
        prog=PROG,
        description="Export a torch_dist checkpoint of our trainer or of Megatron-LM (any "
        "TP/PP layout, Transformer Engine or local spec) to a Hugging Face "
        "directory of its family: LlamaForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM or "
        "GPT2LMHeadModel (safetensors, config.json, tokenizer). See docs/evaluation.md and "
        "docs/moving_checkpoints.md.",
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _export(args), prefix=f"{PROG}: error", output=args.output,
                       wording=TOOLS)


def _export(args) -> int:
    # the model code after the flags: --help and a bad flag answer before it loads
    from megatron_jreg.checkpoint.to_hf import convert

    try:  # a kill removes the temporary export on the way out, as Ctrl-C does
        with signals_as_interrupt():
            warnings = convert(
                args.load,
                args.output,
                iteration=args.iteration,
                dtype=args.dtype,
                tokenizer_model=args.tokenizer_model,
                skip_tokenizer=args.no_tokenizer,
            )
    except KeyboardInterrupt as stopped:
        print(f"{PROG}: stopped ({stop_reason(stopped)}); temporary files removed, nothing "
              f"written to {args.output}", file=sys.stderr)
        return INTERRUPTED
    for warning in warnings:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)
    print(f"wrote {args.output}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
