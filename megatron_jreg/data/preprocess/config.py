"""``tools/preprocess_data.py``'s validated config, whose fields are its flags."""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

from megatron_jreg.config.tokenizer_names import tokenizer_type_error
from megatron_jreg.data.preprocess.chat_templates import resolve_chat_template
from megatron_jreg.data.preprocess.sft_files import metadata_path, sft_prefixes
from megatron_jreg.data.preprocess.sft_workers import OVERLONG_CHOICES, SFTSpec
from megatron_jreg.data.preprocess.sources import INPUT_FORMATS
from megatron_jreg.data.preprocess.workers import EncoderSpec
from megatron_jreg.data.tokenizers.build import MEGATRON_LM_TOKENIZERS
from megatron_jreg.errors import InputError

# Write errors the user fixes by making room; any other OSError is a bug or a system fault.
_NO_ROOM = {errno.ENOSPC: "no space left", getattr(errno, "EDQUOT", -1): "disk quota exceeded"}


class PreprocessError(InputError):
    """A problem the user must fix; the message names it and the fix. Exit code 2."""


class Terminated(BaseException):
    """SIGTERM, raised in the parent so cleanup runs like it does for Ctrl-C."""


@dataclass(kw_only=True)
class PreprocessConfig:
    """One preprocessing run; field names follow Megatron-LM's flags."""

    input: list[str] = field(metadata={"group": "input"})
    """JSONL files, globs or directories (.gz/.zst and Parquet where installed)."""
    output_prefix: str = field(metadata={"group": "output"})
    """Writes <output_prefix>_<key>_document.bin/.idx per JSON key."""
    tokenizer_type: str = field(metadata={"group": "tokenizer", "metavar": "TYPE"})
    """The tokenizer class, as Megatron-LM names it, giving Megatron-LM's ids:
    GPTSentencePieceTokenizer, SentencePieceTokenizer, Llama2Tokenizer, HuggingFaceTokenizer,
    GPT2BPETokenizer, NullTokenizer; or ByteTokenizer (UTF-8 bytes, needs no file)."""
    tokenizer_model: str | None = field(default=None, metadata={"group": "tokenizer"})
    """The tokenizer file: sentencepiece .model (GPTSentencePieceTokenizer,
    SentencePieceTokenizer, Llama2Tokenizer),
    tokenizer.json or its directory (not needed for ByteTokenizer and NullTokenizer)."""
    vocab_file: str | None = field(default=None, metadata={"group": "tokenizer"})
    """GPT2BPETokenizer: GPT-2's vocab.json."""
    merge_file: str | None = field(default=None, metadata={"group": "tokenizer"})
    """GPT2BPETokenizer: GPT-2's merges.txt."""
    vocab_size: int | None = field(default=None, metadata={"group": "tokenizer"})
    """ByteTokenizer: pad its vocabulary to this size; NullTokenizer: the ids below its
    end-of-document id, which is this number."""
    json_keys: list[str] = field(default_factory=lambda: ["text"], metadata={"group": "input"})
    """Keys to extract; each gives its own dataset, documents aligned across them."""
    input_format: str = field(
        default="jsonl", metadata={"group": "input", "choices": INPUT_FORMATS})
    """``jsonl`` or ``text`` (one document per line); ``.parquet`` files are detected."""
    workers: int = field(default=1, metadata={"group": "runtime"})
    """Tokenising processes; the parent only reads and writes."""
    partitions: int = field(default=1, metadata={"group": "runtime"})
    """Cut the input into this many parts, processed concurrently, then merged."""
    append_eod: bool = field(default=False, metadata={"group": "tokenizer"})
    """Append the tokenizer's EOD id to every document (what GPT pretraining wants)."""
    legacy_tokenizer: bool = field(default=False, metadata={"group": "tokenizer"})
    """Megatron-LM's legacy tokenizer ids: SentencePieceTokenizer with its added <CLS>,
    <SEP>, <EOD>, <MASK> and <EOD> as EOD, Llama2Tokenizer with BOS first,
    HuggingFaceTokenizer with the tokenizer's special tokens; other types write the same
    ids either way. Train on such data with --legacy-tokenizer too."""
    split_sentences: bool = field(default=False, metadata={"group": "input"})
    """One sequence per sentence (nltk punkt); output key level becomes ``sentence``."""
    keep_newlines: bool = field(default=False, metadata={"group": "input"})
    """With ``--split-sentences``: keep newlines between sentences."""
    skip_invalid: bool = field(default=False, metadata={"group": "input"})
    """Skip and count bad lines instead of stopping at the first one."""
    overwrite: bool = field(default=False, metadata={"group": "output"})
    """Replace existing outputs instead of refusing."""
    allow_empty: bool = field(default=False, metadata={"group": "output"})
    """Write an empty dataset when the input holds no documents, instead of refusing with
    exit status 2 (an empty dataset cannot be trained on)."""
    sft: bool = field(default=False, metadata={"group": "sft"})
    """Chat data for supervised fine-tuning: JSONL lines {"messages": [{"role", "content"},
    ...]} become <output_prefix>_sft_document (tokens), ..._loss_mask (1 on assistant
    content and its end-of-turn token) and a .json of metadata."""
    chat_template: str = field(default="auto", metadata={"group": "sft", "metavar": "TEMPLATE"})
    """With --sft: auto (the tokenizer's own chat_template, else tulu), tulu, tokenizer, or
    a .jinja file."""
    max_seq_length: int | None = field(default=None, metadata={"group": "sft"})
    """With --sft: conversations longer than this many tokens are skipped or truncated
    (--overlong); none by default."""
    overlong: str = field(default="skip", metadata={"group": "sft", "choices": OVERLONG_CHOICES})
    """With --sft: skip a conversation over --max-seq-length (counted), or truncate it (a
    truncated answer teaches answers that stop without an end)."""
    log_interval: int = field(default=10000, metadata={"group": "runtime"})
    """Documents between progress log lines (when not on a terminal)."""
    chunk_bytes: int = field(default=1 << 18, metadata={"group": "runtime"})
    """Bytes of input per worker message: big enough to amortise the message, small enough
    for load balance and bounded memory."""

    max_line_bytes: int = field(default=1 << 27, metadata={"group": "input"})
    """Refuse a line (one JSON record or text document) longer than this many bytes, naming
    it, before reading more of it: a line is held whole, with its tokens, while it is
    encoded. At least --chunk-bytes; default 128 MiB."""

    def __post_init__(self) -> None:
        for name in ("workers", "partitions", "log_interval", "chunk_bytes", "max_line_bytes"):
            value = getattr(self, name)
            if value < 1:
                raise PreprocessError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.max_line_bytes < self.chunk_bytes:
            raise PreprocessError(
                f"--max-line-bytes {self.max_line_bytes} is below --chunk-bytes "
                f"{self.chunk_bytes}; raise it (or lower --chunk-bytes)")
        error = tokenizer_type_error(self.tokenizer_type)
        if error:
            raise PreprocessError(error)
        if (self.vocab_file or self.merge_file) and self.tokenizer_type != "GPT2BPETokenizer":
            raise PreprocessError("--vocab-file and --merge-file are GPT2BPETokenizer's files; "
                                  "pass --tokenizer-type GPT2BPETokenizer (or drop them)")
        if self.input_format not in INPUT_FORMATS:
            raise PreprocessError(f"--input-format must be one of {INPUT_FORMATS}")
        if not self.json_keys or len(set(self.json_keys)) != len(self.json_keys):
            raise PreprocessError(
                f"--json-keys must be distinct and non-empty, got {self.json_keys}")
        if self.input_format == "text" and len(self.json_keys) != 1:
            raise PreprocessError("--input-format text has one document per line; drop --json-keys")
        if self.keep_newlines and not self.split_sentences:
            raise PreprocessError("--keep-newlines only applies with --split-sentences")
        if self.sft:
            self._check_sft()
        else:
            for flag, value, default in (("--chat-template", self.chat_template, "auto"),
                                         ("--max-seq-length", self.max_seq_length, None),
                                         ("--overlong", self.overlong, "skip")):
                if value != default:
                    raise PreprocessError(f"{flag} only applies with --sft")

    def _check_sft(self) -> None:
        if self.tokenizer_type in MEGATRON_LM_TOKENIZERS:
            raise PreprocessError(
                f"--sft does not support --tokenizer-type {self.tokenizer_type} yet; use "
                f"GPTSentencePieceTokenizer, SentencePieceTokenizer, HuggingFaceTokenizer or "
                f"ByteTokenizer")
        for flag, on in (("--append-eod", self.append_eod),
                         ("--legacy-tokenizer", self.legacy_tokenizer),
                         ("--split-sentences", self.split_sentences),
                         ("--input-format text", self.input_format == "text"),
                         ("--json-keys", self.json_keys != ["text"])):
            if on:
                raise PreprocessError(
                    f"{flag} does not apply with --sft (each line is one conversation under "
                    f"'messages', and the chat template ends turns with the EOS); drop it")
        if self.max_seq_length is not None and self.max_seq_length < 1:
            raise PreprocessError(f"--max-seq-length must be at least 1, got {self.max_seq_length}")
        if self.overlong not in OVERLONG_CHOICES:
            raise PreprocessError(f"--overlong must be one of {OVERLONG_CHOICES}")

    @property
    def level(self) -> str:
        return "sentence" if self.split_sentences else "document"

    def output_prefixes(self) -> list[str]:
        if self.sft:
            return sft_prefixes(self.output_prefix)
        return [f"{self.output_prefix}_{key}_{self.level}" for key in self.json_keys]

    def output_paths(self) -> list[str]:
        """Every file a run writes (an SFT run adds its metadata)."""
        prefixes = self.output_prefixes()
        paths = [prefix + ext for prefix in prefixes for ext in (".bin", ".idx")]
        return paths + ([metadata_path(prefixes[0])] if self.sft else [])

    @property
    def read_keys(self) -> list[str]:
        """The JSON keys (Parquet columns) read from each record."""
        return ["messages"] if self.sft else list(self.json_keys)

    def encoder_spec(self) -> EncoderSpec | SFTSpec:
        """What workers need; for --sft the chat template is read here, once (InputError)."""
        if self.sft:
            name, template = resolve_chat_template(
                self.chat_template, self.tokenizer_type, self.tokenizer_model)
            return SFTSpec(
                tokenizer_type=self.tokenizer_type,
                tokenizer_model=self.tokenizer_model,
                vocab_size=self.vocab_size,
                template_name=name,
                template=template,
                skip_invalid=self.skip_invalid,
                max_seq_length=self.max_seq_length,
                overlong=self.overlong,
            )
        return EncoderSpec(
            tokenizer_type=self.tokenizer_type,
            tokenizer_model=self.tokenizer_model,
            vocab_size=self.vocab_size,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            legacy=self.legacy_tokenizer,
            json_keys=tuple(self.json_keys),
            append_eod=self.append_eod,
            skip_invalid=self.skip_invalid,
            split_sentences=self.split_sentences,
            keep_newlines=self.keep_newlines,
        )
