"""Worker side of preprocessing: a chunk of raw lines in, packed token arrays out.

Workers parse, validate and tokenise a whole chunk per inter-process message and return
numpy buffers, so the parent only writes bytes. Nothing here imports megatron-core or
torch (seconds of import time per worker, and not needed).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from dataclasses import dataclass, field

import numpy

from megatron_jreg.data.preprocess.parent_death import die_with_parent
from megatron_jreg.data.preprocess.sources import Chunk
from megatron_jreg.data.tokenizers.build import build_tokenizer, pack

# Skip reasons, as counted and printed with --skip-invalid.
MALFORMED_JSON = "malformed JSON"
NOT_AN_OBJECT = "not a JSON object"
MISSING_KEY = "missing key"
NON_STRING = "non-string value"
INVALID_UTF8 = "invalid UTF-8"
EMPTY_DOCUMENT = "empty document"
LONE_SURROGATE = "lone surrogate (not valid Unicode)"
UNENCODABLE = "text the tokenizer cannot encode"

# JSON can escape half a UTF-16 pair ("\udcff"); such a string has no UTF-8 form, so no
# tokenizer can take it. Searched for while parsing (after a much faster isascii), so it is
# reported like any bad line.
_SURROGATE = re.compile("[\ud800-\udfff]")


def token_dtype(vocab_size: int) -> type[numpy.number]:
    """uint16 when every id fits, else int32: megatron-core's ``DType.optimal_dtype`` rule.

    Restated here so workers need not import megatron-core; a test pins it to the original.
    """
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a worker needs; picklable, so it also works with the spawn start method."""

    tokenizer_type: str
    tokenizer_model: str | None
    vocab_size: int | None
    json_keys: tuple[str, ...]
    append_eod: bool
    skip_invalid: bool
    split_sentences: bool = False
    keep_newlines: bool = False
    vocab_file: str | None = None
    merge_file: str | None = None
    """GPT2BPETokenizer's vocab.json and merges.txt."""
    legacy: bool = False
    """Megatron-LM's legacy tokenizer ids (``--legacy-tokenizer``)."""

    def build(self) -> "DocumentEncoder":
        """The encoder a worker runs (``SFTSpec.build`` gives the chat one)."""
        return DocumentEncoder(self)


@dataclass
class EncodedKey:
    """One JSON key's documents from one chunk, ready to append to its dataset."""

    tokens: numpy.ndarray
    """All token ids, concatenated, in the dataset's dtype."""
    sequence_lengths: numpy.ndarray
    """int32 tokens per sequence (one sequence per document unless splitting sentences)."""
    sequences_per_document: numpy.ndarray | None
    """int32 sequences per document; None when every document is one sequence."""


@dataclass
class EncodedChunk:
    """A worker's answer for one chunk."""

    keys: list[EncodedKey] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict[str, int] = field(default_factory=dict)
    """Reason -> first chunk-relative line (0-based) skipped for it, for the log."""
    error: tuple[int, str] | None = None
    """(chunk-relative 0-based line, message) of the first bad line without --skip-invalid."""
    counts: Counter = field(default_factory=Counter)
    """Totals of one kind of data (SFT: truncated conversations, loss-masked tokens)."""


class BadLine(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def split_lines(payload: bytes | bytearray) -> list[str | BadLine]:
    """Decoded lines; a line that is not UTF-8 becomes a BadLine in its place."""
    newline = payload.find(b"\n")
    if newline in (-1, len(payload) - 1):
        # One line (a long one comes alone): decoded in place, not split into a second copy.
        end = len(payload) if newline == -1 else newline
        try:
            return [str(memoryview(payload)[:end], "utf-8")]
        except UnicodeDecodeError as e:
            return [BadLine(INVALID_UTF8, (
                f"invalid UTF-8 (byte 0x{payload[e.start]:02x} at byte {e.start + 1} "
                f"of the line)"))]
    try:
        lines: list = payload.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        lines = []
        for raw in payload.split(b"\n"):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                lines.append(BadLine(INVALID_UTF8, (
                    f"invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                    f"of the line)")))
    if payload.endswith(b"\n"):
        lines.pop()  # the empty string after the final newline is not a line
    return lines


def surrogate_error(value: str, where: str) -> BadLine | None:
    """The problem of a string holding a lone surrogate (no UTF-8 form), or None."""
    surrogate = None if value.isascii() else _SURROGATE.search(value)
    if surrogate is None:
        return None
    return BadLine(LONE_SURROGATE, (
        f"lone surrogate \\u{ord(surrogate.group()):04x} at character "
        f"{surrogate.start() + 1} of {where} (a JSON escape that is not valid Unicode)"))


class _Unencodable(Exception):
    """Documents the tokenizer raised on: (index into the chunk's good ones, detail), in order."""

    def __init__(self, failures: list[tuple[int, str]]) -> None:
        super().__init__(failures[0][1])
        self.failures = failures


class _SentenceSplitter:
    """nltk punkt, as Megatron-LM's ``--split-sentences`` uses; optional dependency."""

    def __init__(self, keep_newlines: bool) -> None:
        import nltk

        try:
            splitter = nltk.load("tokenizers/punkt/english.pickle")
        except LookupError:
            # nltk >= 3.9 reads this name from the pickle-free ``punkt_tab`` data; older
            # releases unpickle ``punkt``.
            data = "punkt_tab" if hasattr(nltk.tokenize, "PunktTokenizer") else "punkt"
            raise RuntimeError(
                f"--split-sentences needs nltk's {data} data; run "
                f"python -c \"import nltk; nltk.download('{data}')\" (or point NLTK_DATA at it)"
            ) from None
        if keep_newlines:
            # Punkt drops newlines between sentences; this keeps them, as Megatron-LM does.
            splitter = nltk.tokenize.punkt.PunktSentenceTokenizer(
                train_text=splitter._params, lang_vars=_newline_lang_vars(nltk)()
            )
        self._splitter = splitter

    def split(self, text: str) -> list[str]:
        return self._splitter.tokenize(text)


def _newline_lang_vars(nltk):
    class NewlineLangVars(nltk.tokenize.punkt.PunktLanguageVars):
        _period_context_fmt = r"""
            \S*                          # some word material
            %(SentEndChars)s             # a potential sentence ending
            \s*                       #  <-- THIS is what I changed
            (?=(?P<after_tok>
                %(NonWord)s              # either other punctuation
                |
                (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
            ))"""

    return NewlineLangVars


class DocumentEncoder:
    """Turns chunks into ``EncodedChunk``s with one tokenizer, in any process."""

    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self.tokenizer = build_tokenizer(spec.tokenizer_type, spec.tokenizer_model, spec.vocab_size,
                                         vocab_file=spec.vocab_file, merge_file=spec.merge_file,
                                         legacy=spec.legacy)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.dtypes = [self.dtype] * len(spec.json_keys)  # one dataset per key
        self._splitter = _SentenceSplitter(spec.keep_newlines) if spec.split_sentences else None

    # -- parsing ---------------------------------------------------------------------------
    def _texts_from_record(self, record) -> list[str]:
        if not isinstance(record, dict):
            raise BadLine(NOT_AN_OBJECT, f"expected a JSON object, got {type(record).__name__}")
        texts = []
        for key in self.spec.json_keys:
            if key not in record:
                present = ", ".join(list(record)[:8]) or "none"
                raise BadLine(MISSING_KEY, f"missing key {key!r} (keys present: {present})")
            value = record[key]
            if not isinstance(value, str):
                raise BadLine(
                    NON_STRING, f"value of {key!r} is {type(value).__name__}, expected a string"
                )
            if not value or value.isspace():  # strip() would copy a long document
                raise BadLine(EMPTY_DOCUMENT, f"empty document in {key!r}")
            bad = surrogate_error(value, repr(key))
            if bad is not None:
                raise bad
            texts.append(value)
        return texts

    def _parse(self, chunk: Chunk, kind: str) -> list[tuple[int, list[str] | BadLine]]:
        """(chunk-relative line, texts per key or the problem) for every non-blank line."""
        out = []
        if chunk.rows is not None:
            for i, row in enumerate(chunk.rows):
                try:
                    out.append((i, self._texts_from_record(row)))
                except BadLine as bad:
                    out.append((i, bad))
            return out
        # The chunk's bytes are taken, and go once decoded: a long line is not held twice.
        payload, chunk.lines = chunk.lines, None
        lines = split_lines(payload)
        del payload
        for i in range(len(lines)):
            line, lines[i] = lines[i], None  # each line goes once parsed
            if isinstance(line, BadLine):
                out.append((i, line))
            elif kind == "text":
                text = line.removesuffix("\r")
                out.append((i, [text] if text and not text.isspace() else BadLine(
                    EMPTY_DOCUMENT, "empty document (a blank line)")))
            elif line and not line.isspace():  # blank lines between records are not documents
                try:
                    record = json.loads(line)
                except ValueError as e:
                    out.append((i, BadLine(MALFORMED_JSON, f"malformed JSON ({e})")))
                    continue
                try:
                    out.append((i, self._texts_from_record(record)))
                except BadLine as bad:
                    out.append((i, bad))
        return out

    # -- encoding --------------------------------------------------------------------------
    def _encode_documents(self, texts: list[str], key: str) -> EncodedKey:
        """``_encode_batch``, or _Unencodable naming every document the tokenizer rejects."""
        try:
            return self._encode_batch(texts)
        except Exception:
            # Rare: find the documents, one at a time, so the error names their lines.
            failures = []
            for i, text in enumerate(texts):
                try:
                    self._encode_batch([text])
                except Exception as e:
                    failures.append(
                        (i, f"the tokenizer cannot encode {key!r} ({type(e).__name__}: {e})"))
            if failures:
                raise _Unencodable(failures) from None
            raise  # no single document fails: a tokenizer problem, not a data one

    def _encode_batch(self, texts: list[str]) -> EncodedKey:
        tok = self.tokenizer
        if self._splitter is None:
            # One call per chunk, as arrays: the tokenizer's batch path skips per-document
            # call overhead, and arrays skip a Python int per token where the library can.
            # It writes the dataset's dtype and the EODs itself: a long document's ids are
            # then held once, not again for the cast and again for the EODs.
            ids, lengths = tok.encode_packed(
                texts, self.dtype, tok.eod if self.spec.append_eod else None)
            return EncodedKey(ids, lengths, None)
        # Megatron-LM's rule: sentences that encode to nothing are dropped, and EOD joins
        # the document's last sentence.
        flat, counts = [], []
        for text in texts:
            sentences = [s for s in map(tok.encode, self._splitter.split(text)) if s]
            if sentences and self.spec.append_eod:
                sentences[-1].append(tok.eod)
            flat.extend(sentences)
            counts.append(len(sentences))
        ids, lengths = pack(flat)
        return EncodedKey(ids.astype(self.dtype, copy=False), lengths,
                          numpy.asarray(counts, dtype=numpy.int32))

    def encode_chunk(self, chunk: Chunk, kind: str) -> EncodedChunk:
        result = EncodedChunk()
        good: list[list[str]] = []
        good_lines: list[int] = []
        first_bad: tuple[int, str] | None = None
        for line, item in self._parse(chunk, kind):
            if isinstance(item, BadLine):
                if not self.spec.skip_invalid:
                    # Documents before it are still encoded: one the tokenizer rejects comes
                    # earlier, and the earliest bad line is the one to report.
                    first_bad = (line, item.detail)
                    break
                self._skip(result, line, item)
            else:
                good.append(item)
                good_lines.append(line)
        while True:
            try:
                keys = [self._encode_documents([texts[k] for texts in good], key)
                        for k, key in enumerate(self.spec.json_keys)]
                break
            except _Unencodable as bad:  # drop the documents from every key, then retry
                if not self.spec.skip_invalid:
                    doc, detail = bad.failures[0]
                    result.error = (good_lines[doc], detail)  # before first_bad, by construction
                    return result
                for doc, detail in bad.failures:
                    self._skip(result, good_lines[doc], BadLine(UNENCODABLE, detail))
                for doc, _ in reversed(bad.failures):  # from the end: indices stay valid
                    del good[doc], good_lines[doc]
        errors = [] if first_bad is None else [first_bad]
        for encoded in keys:
            if self._splitter is None and (encoded.sequence_lengths == 0).any():
                # Only reachable without --append-eod: a zero-length document would
                # break GPTDataset's document walk.
                doc = int(numpy.argmax(encoded.sequence_lengths == 0))
                errors.append((good_lines[doc], "document encodes to no tokens"))
        if errors:
            result.error = min(errors)
            return result
        for encoded in keys:
            result.keys.append(encoded)
            result.tokens += encoded.tokens.size
        result.documents = len(good)
        return result

    @staticmethod
    def _skip(result: EncodedChunk, line: int, bad: BadLine) -> None:
        result.skipped[bad.reason] += 1
        result.first_skipped.setdefault(bad.reason, line)


# -- multiprocessing entry points ------------------------------------------------------------
_ENCODER = None  # a DocumentEncoder, or sft_workers.SFTEncoder


def init_worker(spec, parent_pid: int, encoder=None) -> None:
    """Pool initializer: build the tokenizer once per worker process.

    ``parent_pid`` is the process that owns the pool: the worker dies with it. ``encoder``
    is the parent's, already built for ``spec``: a forked worker inherits it instead of
    loading the tokenizer again (pass None where workers are spawned: it is not picklable).
    """
    global _ENCODER
    die_with_parent(parent_pid)
    # The parent owns Ctrl-C and SIGTERM: it stops the pool and removes partial files.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # One thread per worker: parallelism comes from the worker count.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _ENCODER = encoder if encoder is not None else spec.build()


def encode_chunk_in_worker(chunk: Chunk) -> EncodedChunk:
    assert _ENCODER is not None, "init_worker was not run in this process"
    return _ENCODER.encode_chunk(chunk, chunk.segment.kind)
