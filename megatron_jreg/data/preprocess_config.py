"""``tools/preprocess_data.py``'s flags, validated config and exit codes."""

from __future__ import annotations

import argparse
import errno
from dataclasses import dataclass, field

from megatron_jreg.cli import ArgumentParser
from megatron_jreg.data.document_encoder import EncoderSpec
from megatron_jreg.data.text_sources import INPUT_FORMATS
from megatron_jreg.data.tokenizers import TOKENIZER_TYPES
from megatron_jreg.errors import InputError

EXIT_USAGE = 2  # bad flags, inputs or data: the user must fix something (argparse uses 2 too)
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

# Write errors the user fixes by making room; any other OSError is a bug or a system fault.
_NO_ROOM = {errno.ENOSPC: "no space left", getattr(errno, "EDQUOT", -1): "disk quota exceeded"}


class PreprocessError(InputError):
    """A problem the user must fix; the message names it and the fix. Exit code 2."""


class Terminated(BaseException):
    """SIGTERM, raised in the parent so cleanup runs like it does for Ctrl-C."""


@dataclass(kw_only=True)
class PreprocessConfig:
    """One preprocessing run; field names follow Megatron-LM's flags."""

    input: list[str]
    """JSONL files, globs or directories (``.gz``/``.zst`` and Parquet where installed)."""
    output_prefix: str
    """Writes ``<output_prefix>_<key>_document.bin/.idx`` per JSON key."""
    tokenizer_type: str
    """One of ``TOKENIZER_TYPES``."""
    tokenizer_model: str | None = None
    """The tokenizer file (not needed for ByteTokenizer)."""
    vocab_size: int | None = None
    """ByteTokenizer only: pad its vocabulary to this size."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """Keys to extract; each gives its own dataset, documents aligned across them."""
    input_format: str = "jsonl"
    """``jsonl`` or ``text`` (one document per line); ``.parquet`` files are detected."""
    workers: int = 1
    """Tokenising processes; the parent only reads and writes."""
    partitions: int = 1
    """Cut the input into this many parts, processed concurrently, then merged."""
    append_eod: bool = False
    """Append the tokenizer's EOD id to every document (what GPT pretraining wants)."""
    split_sentences: bool = False
    """One sequence per sentence (nltk punkt); output key level becomes ``sentence``."""
    keep_newlines: bool = False
    """With ``split_sentences``: keep newlines between sentences."""
    skip_invalid: bool = False
    """Skip and count bad lines instead of stopping at the first one."""
    overwrite: bool = False
    """Replace existing outputs instead of refusing."""
    allow_empty: bool = False
    """Write an empty dataset when the input holds no documents, instead of refusing (an
    empty dataset cannot be trained on)."""
    log_interval: int = 10000
    """Documents between progress log lines (when not on a terminal)."""
    chunk_bytes: int = 1 << 18
    """Bytes of input per worker message: big enough to amortise the message, small enough
    for load balance and bounded memory."""

    def __post_init__(self) -> None:
        for name in ("workers", "partitions", "log_interval", "chunk_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise PreprocessError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise PreprocessError(
                f"--tokenizer-type {self.tokenizer_type!r} is not supported; "
                f"use one of {', '.join(TOKENIZER_TYPES)}"
            )
        if self.input_format not in INPUT_FORMATS:
            raise PreprocessError(f"--input-format must be one of {INPUT_FORMATS}")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise PreprocessError(f"--json-keys must be distinct and non-empty, got {self.json_keys}")
        if self.input_format == "text" and len(self.json_keys) != 1:
            raise PreprocessError("--input-format text has one document per line; drop --json-keys")
        if self.keep_newlines and not self.split_sentences:
            raise PreprocessError("--keep-newlines only applies with --split-sentences")

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> list[str]:
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]

    def encoder_spec(self) -> EncoderSpec:
        return EncoderSpec(
            tokenizer_type=self.tokenizer_type,
            tokenizer_model=self.tokenizer_model,
            vocab_size=self.vocab_size,
            json_keys=tuple(self.json_keys),
            append_eod=self.append_eod,
            skip_invalid=self.skip_invalid,
            split_sentences=self.split_sentences,
            keep_newlines=self.keep_newlines,
        )


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        description="Tokenise raw text into megatron-core .bin/.idx datasets.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True, help="JSONL files, globs or directories")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract; one dataset each")
    g.add_argument("--input-format", choices=INPUT_FORMATS, default="jsonl", help="text: one document per line")
    g.add_argument("--split-sentences", action="store_true", help="one sequence per sentence (needs nltk)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines between sentences")
    g.add_argument("--skip-invalid", action="store_true", help="skip and count bad lines instead of stopping")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model, tokenizer.json or its directory")
    g.add_argument("--vocab-size", type=int, default=None, help="ByteTokenizer only: padded vocabulary size")
    g.add_argument("--append-eod", action="store_true", help="append the EOD id to every document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    g.add_argument("--allow-empty", action="store_true",
                   help="write an empty dataset when the input holds no documents (else exit 2)")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenising processes")
    g.add_argument("--partitions", type=int, default=1, help="input parts processed concurrently, then merged")
    g.add_argument("--log-interval", type=int, default=10000, help="documents between log lines")
    g.add_argument("--chunk-bytes", type=int, default=1 << 18, help="input bytes per worker message")
    return p


def config_from_args(argv: list[str] | None = None) -> PreprocessConfig:
    args = build_parser().parse_args(argv)
    return PreprocessConfig(**{k: v for k, v in vars(args).items()})
