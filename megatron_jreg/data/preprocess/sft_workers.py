"""Worker side of ``preprocess_data.py --sft``: chat JSONL lines in, tokens and loss masks out.

Each line is one conversation, ``{"messages": [{"role", "content"}, ...]}``; other fields, of
the record or of a message, are ignored. A chunk's answer holds two datasets' worth of
bytes, the tokens and the uint8 loss mask, one sequence per conversation in both, so the
parent writes them like any other preprocessing output (identical for any worker count).
Like ``workers``, nothing here imports megatron-core or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy

from megatron_jreg.data.preprocess.chat_templates import ROLES, ChatEncoder, ConversationError
from megatron_jreg.data.preprocess.sft_files import FORMAT
from megatron_jreg.data.preprocess.sources import Chunk
from megatron_jreg.data.preprocess.workers import (
    MALFORMED_JSON,
    NOT_AN_OBJECT,
    UNENCODABLE,
    BadLine,
    EncodedChunk,
    EncodedKey,
    split_lines,
    surrogate_error,
    token_dtype,
)
from megatron_jreg.data.tokenizers.build import build_tokenizer
from megatron_jreg.errors import InputError

OVERLONG_CHOICES = ("skip", "truncate")

# Skip reasons, as counted and printed with --skip-invalid.
NO_MESSAGES = "no messages list"
EMPTY_CONVERSATION = "empty conversation"
BAD_MESSAGE = "bad message"
BAD_ROLE = "bad role"
NON_STRING_CONTENT = "non-string content"
NO_ASSISTANT = "no assistant message"
# Counted whatever --skip-invalid says: --overlong decides, not the data's validity.
OVERLONG = "longer than --max-seq-length"
NOTHING_LEFT = "no assistant token within --max-seq-length"


@dataclass(frozen=True)
class SFTSpec:
    """Everything an SFT worker needs; picklable."""

    tokenizer_type: str
    tokenizer_model: str | None
    vocab_size: int | None
    template_name: str
    template: str
    """The jinja text of the chat template."""
    skip_invalid: bool
    max_seq_length: int | None = None
    overlong: str = "skip"

    def build(self) -> "SFTEncoder":
        return SFTEncoder(self)


def conversation_from_record(record) -> list[dict]:
    """The record's messages as ``{"role", "content"}`` dicts; BadLine says what is wrong."""
    if not isinstance(record, dict):
        raise BadLine(NOT_AN_OBJECT, f"expected a JSON object, got {type(record).__name__}")
    if "messages" not in record:
        present = ", ".join(list(record)[:8]) or "none"
        raise BadLine(NO_MESSAGES, f"missing key 'messages' (keys present: {present})")
    messages = record["messages"]
    if not isinstance(messages, list):
        raise BadLine(NO_MESSAGES, f"'messages' is {type(messages).__name__}, expected a list")
    if not messages:
        raise BadLine(EMPTY_CONVERSATION, "empty conversation ('messages' is [])")
    out = []
    for n, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise BadLine(BAD_MESSAGE, (f"message {n} is {type(message).__name__}, expected an "
                                        f"object with 'role' and 'content'"))
        role = message.get("role")
        if role not in ROLES:
            raise BadLine(BAD_ROLE, (f"message {n} has role {role!r}; expected 'system', "
                                     f"'user' or 'assistant'"))
        content = message.get("content")
        if not isinstance(content, str):
            raise BadLine(NON_STRING_CONTENT, (f"content of message {n} is "
                                               f"{type(content).__name__}, expected a string"))
        bad = surrogate_error(content, f"message {n}")
        if bad is not None:
            raise bad
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadLine(NO_ASSISTANT, "no assistant message, so nothing to train on")
    return out


class SFTEncoder:
    """Turns chunks of chat JSONL into tokens and loss masks, in any process."""

    def __init__(self, spec: SFTSpec) -> None:
        self.spec = spec
        self.tokenizer = build_tokenizer(spec.tokenizer_type, spec.tokenizer_model, spec.vocab_size)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.dtypes = [self.dtype, numpy.uint8]  # tokens, loss mask
        try:
            self.chat = ChatEncoder(self.tokenizer, spec.template, spec.tokenizer_model)
            self.chat.check()
        except ValueError as e:  # InputError: which template, what is wrong with it
            raise InputError(f"--chat-template {spec.template_name}: {e}") from None

    def _records(self, chunk: Chunk):
        """(chunk-relative line, record or BadLine) of every non-blank line."""
        if chunk.rows is not None:  # Parquet: a "messages" column of structs
            yield from enumerate(chunk.rows)
            return
        for i, line in enumerate(split_lines(chunk.lines)):
            if isinstance(line, BadLine):
                yield i, line
            elif line.strip():  # blank lines between records are not conversations
                try:
                    yield i, json.loads(line)
                except ValueError as e:
                    yield i, BadLine(MALFORMED_JSON, f"malformed JSON ({e})")

    def _encode(self, record) -> tuple[list[int], list[int]]:
        if isinstance(record, BadLine):
            raise record
        messages = conversation_from_record(record)
        try:
            return self.chat.encode(messages)
        except ConversationError as e:
            raise BadLine(e.reason, e.detail) from None
        except Exception as e:  # the tokenizer's own failure on this text
            raise BadLine(UNENCODABLE, f"the tokenizer cannot encode it ({type(e).__name__}: "
                                       f"{e})") from None

    def encode_chunk(self, chunk: Chunk, kind: str = "jsonl") -> EncodedChunk:
        result = EncodedChunk()
        tokens: list[int] = []
        masks: list[int] = []
        lengths: list[int] = []
        limit = self.spec.max_seq_length
        for line, record in self._records(chunk):
            try:
                ids, mask = self._encode(record)
            except BadLine as bad:
                if not self.spec.skip_invalid:
                    result.error = (line, bad.detail)
                    return result
                self._skip(result, line, bad.reason)
                continue
            if limit is not None and len(ids) > limit:
                if self.spec.overlong == "skip":
                    self._skip(result, line, OVERLONG)
                    continue
                ids, mask = ids[:limit], mask[:limit]
                if not any(mask):
                    self._skip(result, line, NOTHING_LEFT)
                    continue
                result.counts["truncated"] += 1
            tokens.extend(ids)
            masks.extend(mask)
            lengths.append(len(ids))
        sizes = numpy.asarray(lengths, dtype=numpy.int32)
        result.keys = [
            EncodedKey(numpy.asarray(tokens, dtype=self.dtype), sizes, None),
            EncodedKey(numpy.asarray(masks, dtype=numpy.uint8), sizes, None),
        ]
        result.documents = len(lengths)
        result.tokens = len(tokens)
        result.counts["loss_tokens"] += sum(masks)
        return result

    @staticmethod
    def _skip(result: EncodedChunk, line: int, reason: str) -> None:
        result.skipped[reason] += 1
        result.first_skipped.setdefault(reason, line)


def sft_metadata(spec: SFTSpec, encoder: SFTEncoder, stats) -> dict:
    """The ``.json`` beside an SFT dataset (``stats``: the run's ``RunStats``)."""
    tokenizer = encoder.tokenizer
    return {
        "format": FORMAT,
        "chat_template_name": spec.template_name,
        "chat_template": spec.template,
        "tokenizer_type": spec.tokenizer_type,
        "tokenizer_model": spec.tokenizer_model,
        "tokenizer": tokenizer.unique_identifiers,
        "vocab_size": tokenizer.vocab_size,
        "eod": tokenizer.eod,
        "token_dtype": numpy.dtype(encoder.dtype).name,
        "max_seq_length": spec.max_seq_length,
        "overlong": spec.overlong,
        "counts": {
            "conversations": stats.documents,
            "tokens": stats.tokens,
            "loss_tokens": stats.counts.get("loss_tokens", 0),
            "truncated": stats.counts.get("truncated", 0),
            "skipped": sum(stats.skipped.values()),
            "skipped_by_reason": dict(sorted(stats.skipped.items())),
        },
    }
