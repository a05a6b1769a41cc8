"""Convert a Hugging Face causal LM into a megatron-jreg checkpoint.

    python tools/convert_from_hf.py --hf-model DIR --save CKPT

Runs on one process; the mapping and the checks live in
``megatron_jreg.checkpoint.from_hf``; see docs/families.md.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from megatron_jreg.atomic_write import signals_as_interrupt, stop_reason
from megatron_jreg.commands.exit_codes import INTERRUPTED, OK, run_command
from megatron_jreg.commands.flags import ArgumentParser, tool_parser
from megatron_jreg.hf_models import CHECKPOINT_DTYPES

PROG = "convert_from_hf"


@dataclass(kw_only=True)
class ImportConfig:
    """The flags of ``convert_from_hf``; ``main`` hands them to ``from_hf.convert``."""

    hf_model: str = field(metadata={
        "metavar": "REF", "help": "a Hugging Face causal LM: a directory written by "
        "save_pretrained, a .gguf file, or a hub id already in the local cache (offline)"})
    save: str = field(metadata={"metavar": "CKPT", "help": "a new (or empty) checkpoint "
                                "directory to write"})
    tensor_model_parallel_size: int = field(default=1, metadata={
        "metavar": "N", "help": "check that the model splits over N tensor-parallel ranks "
        "(the files serve every layout: dist-checkpointing reshards at load)"})
    pipeline_model_parallel_size: int = field(default=1, metadata={
        "metavar": "M", "help": "check that the layers split over M pipeline stages"})
    dtype: str = field(default="float32", metadata={
        "choices": sorted(CHECKPOINT_DTYPES),
        "help": "dtype of the saved weights (bfloat16 sets --bf16 in the run config)"})


def build_parser() -> ArgumentParser:
    return tool_parser(
        {None: ImportConfig}, prog=PROG,
        description="Convert a Hugging Face causal LM (Llama, Qwen3, Mixtral or GPT-2 form) "
        "into a megatron-jreg checkpoint that --load, --pretrained-checkpoint (with "
        "--use-checkpoint-args), eval_jump --load and convert_to_hf read. The tokenizer is "
        "copied into the checkpoint. See docs/families.md.")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _import(args), prefix=f"{PROG}: error", output=args.save)


def _import(args) -> int:
    # the model code after the flags: --help and a bad flag answer before it loads
    from megatron_jreg.checkpoint.from_hf import convert

    try:  # the temporary directory is removed on the way out, for a kill as for Ctrl-C
        with signals_as_interrupt():
            summary = convert(args.hf_model, args.save, tp=args.tensor_model_parallel_size,
                              pp=args.pipeline_model_parallel_size, dtype=args.dtype,
                              progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt as stopped:
        print(f"{PROG}: stopped ({stop_reason(stopped)}); nothing "
              f"written to {args.save}", file=sys.stderr)
        return INTERRUPTED
    print(f"wrote {args.save}: {summary['family']}, {summary['layers']} layers, "
          f"{summary['parameters'] / 1e6:.1f}M parameters ({args.dtype}), iteration 0, "
          f"in {summary['seconds']:.1f}s")
    return OK


if __name__ == "__main__":
    sys.exit(main())
