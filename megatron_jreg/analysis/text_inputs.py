"""Evaluation documents: a text file, a JSONL file, or an indexed dataset; then token ids.

Each reader checks its path when called (so a bad path fails before any model loads)
and returns a lazy iterator, so ``--max-tokens`` stops reading a large file early.
A document is a ``str`` (tokenized by the model's tokenizer) or a list of token ids
(an indexed dataset is already tokenized).
"""

from __future__ import annotations

import os
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Union

from megatron_jreg.data.preprocess.sources import BadLineError, jsonl_records, utf8_lines
from megatron_jreg.errors import InputError

Document = Union[str, Sequence[int]]


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


def read_indexed_dataset(prefix: str) -> Iterator[List[int]]:
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
        raise InputError(f"--data-path {prefix}: not a readable indexed dataset ({e!r})")

    def documents() -> Iterator[List[int]]:
        # A document may span several sequences (sentence splitting): join them.
        bounds = dataset.document_indices
        for d in range(len(bounds) - 1):
            tokens: List[int] = []
            for s in range(int(bounds[d]), int(bounds[d + 1])):
                tokens.extend(int(t) for t in dataset[s])
            if tokens:
                yield tokens

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
        ids = tokenize(doc) if isinstance(doc, str) else list(doc)
        ids = ids[:seq_length]
        if max_tokens is not None:
            ids = ids[: max_tokens - total]
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
