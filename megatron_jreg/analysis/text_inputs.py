"""Evaluation documents: a text file, a JSONL file, or an indexed dataset; then token ids.

Each reader checks its path when called (so a bad path fails before any model loads)
and returns a lazy iterator, so ``--max-tokens`` stops reading a large file early.
A document is a ``str`` (tokenized by the model's tokenizer), a list of token ids, or an
:class:`IndexedDocument` (an indexed dataset is already tokenized). Only the tokens a
document contributes (``--seq-length``, what ``--max-tokens`` still needs) are made: a
long text is tokenized a prefix at a time (:func:`first_tokens`), an indexed document is
read only as far as needed; the ids are exactly those of the whole document, cut.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from megatron_jreg.data.preprocess.sources import BadLineError, jsonl_records, utf8_lines
from megatron_jreg.errors import InputError


class IndexedDocument:
    """One document of a Megatron indexed dataset, read only as far as :meth:`head` asks:
    a document of millions of tokens costs what --seq-length and --max-tokens take of it."""

    def __init__(self, dataset, first: int, end: int) -> None:
        # a document may span several sequences (sentence splitting): first..end-1
        self._dataset, self._first, self._end = dataset, first, end

    def __len__(self) -> int:
        return int(self._dataset.sequence_lengths[self._first : self._end].sum())

    def head(self, n: int) -> List[int]:
        """The document's first ``n`` tokens (all of them when it is shorter)."""
        tokens: List[int] = []
        lengths = self._dataset.sequence_lengths
        for s in range(self._first, self._end):
            if len(tokens) >= n:
                break
            count = min(n - len(tokens), int(lengths[s]))
            tokens.extend(self._dataset.get(s, offset=0, length=count).tolist())
        return tokens


Document = Union[str, Sequence[int], IndexedDocument]


def _check_file(path: str, flag: str) -> None:
    if not os.path.exists(path):
        raise InputError(f"{flag} {path}: no such file; check the path")
    if not os.path.isfile(path):
        raise InputError(f"{flag} {path}: not a regular file; give the path of a file")


def _not_utf8(error: BadLineError, flag: str, what: str) -> InputError:
    return InputError(
        f"{flag} {error.path}:{error.line}: not UTF-8 text (a binary file?); give {what}, "
        "UTF-8 encoded"
    )


def read_text_file(path: str) -> Iterator[str]:
    """One document per line; blank lines are skipped."""
    _check_file(path, "--text-file")

    def lines() -> Iterator[str]:
        try:
            for _, line in utf8_lines(path):
                text = line.rstrip("\r\n")
                if text.strip():
                    yield text
        except BadLineError as e:
            raise _not_utf8(e, "--text-file", "a text file, one document per line") from None

    return lines()


def _jsonl_text(obj: object, key: str, where: str) -> str:
    """The document of one JSONL record: ``obj[key]``, a string."""
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if key not in obj:
        raise InputError(
            f"{where}: no key {key!r} (keys: {sorted(obj)[:8]}); "
            "choose the text key with --json-key"
        )
    text = obj[key]
    if not isinstance(text, str):
        raise InputError(f"{where}: {key!r} holds {type(text).__name__}, expected a string")
    return text


def read_jsonl(path: str, key: str) -> Iterator[str]:
    """One JSON object per line, the document in ``obj[key]``; blank lines are skipped."""
    _check_file(path, "--jsonl")

    def documents() -> Iterator[str]:
        try:
            for lineno, obj in jsonl_records(path):
                text = _jsonl_text(obj, key, f"{path}:{lineno}")
                if text.strip():
                    yield text
        except BadLineError as e:
            if e.json_error is None:
                raise _not_utf8(e, "--jsonl", "a JSON-lines file") from None
            raise InputError(
                f"{path}:{e.line}: malformed JSON ({e.json_error}); each line must be one JSON "
                "object"
            ) from None

    return documents()


def read_indexed_dataset(prefix: str) -> Iterator[IndexedDocument]:
    """The documents of a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) as token ids."""
    missing = [p for p in (prefix + ".idx", prefix + ".bin") if not os.path.isfile(p)]
    if missing:
        raise InputError(
            f"--data-path {prefix}: {' and '.join(missing)} not found; --data-path takes the "
            "dataset prefix without the .bin/.idx extension"
        )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        dataset = IndexedDataset(prefix)
    except Exception as e:  # a corrupt or foreign file; megatron raises bare assertions
        raise InputError(f"--data-path {prefix}: not a readable indexed dataset ({e!r})") from None

    def documents() -> Iterator[IndexedDocument]:
        bounds = dataset.document_indices
        for d in range(len(bounds) - 1):
            document = IndexedDocument(dataset, int(bounds[d]), int(bounds[d + 1]))
            if len(document):
                yield document

    return documents()


def read_documents(
    text_file: Optional[str] = None,
    jsonl: Optional[str] = None,
    json_key: str = "text",
    data_path: Optional[str] = None,
) -> Iterator[Document]:
    """The documents of exactly one of the three inputs."""
    given = [
        flag
        for flag, value in (
            ("--text-file", text_file),
            ("--jsonl", jsonl),
            ("--data-path", data_path),
        )
        if value
    ]
    if not given:
        raise InputError(
            "no evaluation text: give --text-file, --jsonl (with --json-key) or --data-path"
        )
    if len(given) > 1:
        raise InputError(f"{' and '.join(given)} were both given; choose one evaluation input")
    if text_file:
        return read_text_file(text_file)
    if jsonl:
        return read_jsonl(jsonl, json_key)
    return read_indexed_dataset(data_path)


# Tokens tokenized past the ones kept when a text is cut (see first_tokens).
MARGIN_TOKENS = 32
# The first prefix's characters per token needed: above most tokenizers' ratio (English BPE
# about 4, bytes 1), so one prefix is usually enough; a short one grows (see first_tokens).
FIRST_CHARS_PER_TOKEN = 8
# Where a text may be cut: a single space between two word characters.
_CUT = re.compile(r"(?<=\w) (?=\w)")


def first_tokens(tokenize: Callable[[str], List[int]], text: str, n: int) -> List[int]:
    """``tokenize(text)[:n]``, tokenizing only a prefix of ``text`` when it is long.

    The prefix ends at a single space between two word characters, at or after a length
    in proportion to the ``n + MARGIN_TOKENS`` tokens needed. Why the ids are those of the
    whole text: tokenizers split text into words before merging (the BPE pre-tokenizers of
    GPT-2, Llama 3, SmolLM; SentencePiece's whitespace split), and such a space is a word
    boundary in every one of them (the space goes with the next word: GPT-2's ``" ?\\p{L}+"``
    and Llama 3's ``"[^\\r\\n\\p{L}\\p{N}]?\\p{L}+"``), so no token before the cut sees what
    follows it. What the cut can change is at its end (an end-of-text token a post-processor
    adds, a piece spanning words in a SentencePiece model without the whitespace split), so
    the last MARGIN_TOKENS tokens of the prefix are never kept: a prefix that gives fewer than
    ``n + MARGIN_TOKENS`` grows to the length that, at its own characters per token, gives
    them with a quarter to spare (at least doubled), and is tokenized again. A text with no
    such space past the length (one long word, text without spaces) is tokenized whole, as
    every text was before.
    """
    chars = (n + MARGIN_TOKENS) * FIRST_CHARS_PER_TOKEN
    while True:
        cut = _CUT.search(text, chars) if chars < len(text) else None
        if cut is None:
            return tokenize(text)[:n]
        ids = tokenize(text[: cut.start()])
        if len(ids) >= n + MARGIN_TOKENS:
            return ids[:n]
        per_token = cut.start() / max(len(ids), 1)
        chars = max(2 * cut.start(), int(per_token * (n + MARGIN_TOKENS) * 1.25) + 1)


def token_sequences(
    documents: Iterable[Document],
    tokenize: Callable[[str], List[int]],
    seq_length: int,
    max_tokens: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> Iterator[List[int]]:
    """One token sequence per document, cut to ``seq_length``; stops at ``max_tokens``.

    The last sequence is cut so the total is exactly ``max_tokens`` when the input has
    that many. Documents that tokenize to nothing are skipped.
    """
    if seq_length < 1:
        raise InputError(f"--seq-length must be >= 1, got {seq_length}")
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"--max-tokens must be >= 1, got {max_tokens}")
    total = 0
    for doc in documents:
        need = seq_length if max_tokens is None else min(seq_length, max_tokens - total)
        if isinstance(doc, str):
            ids = first_tokens(tokenize, doc, need)
        elif isinstance(doc, IndexedDocument):
            ids = doc.head(need)
        else:
            ids = list(doc[:need])
        if not ids:
            continue
        if vocab_size is not None:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                bad = bad[0]
                raise InputError(
                    f"token id {bad} is outside the model's vocabulary of {vocab_size}; "
                    "the dataset was tokenized with another tokenizer"
                )
        total += len(ids)
        yield ids
        if max_tokens is not None and total >= max_tokens:
            return
