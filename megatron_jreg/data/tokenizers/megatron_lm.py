"""Megatron-LM's tokenizer types that ``tokenizers.build`` does not build itself:
``Llama2Tokenizer``, ``GPT2BPETokenizer`` and ``NullTokenizer``, as Megatron-LM 0.16's
``megatron/training/tokenizer/tokenizer.py`` defines them (its default, legacy path).

Same interface as ``tokenizers.build``, which builds them through
:func:`build_megatron_tokenizer`. ``Llama2Tokenizer`` gives both of Megatron-LM's id sets
(sentencepiece's, and with ``--legacy-tokenizer`` a BOS before every text), so
``preprocess_data.py`` writes what Megatron-LM writes with the same flags. Imports neither
torch nor megatron-core: preprocessing workers import it.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy

from megatron_jreg.config.tokenizer_names import MEGATRON_LM_TOKENIZERS
from megatron_jreg.data.tokenizers.records import LEGACY_IDS, MEGATRON_CORE_IDS, EarlierRecord
from megatron_jreg.data.tokenizers.token_arrays import file_sha256, pack, pack_texts
from megatron_jreg.errors import InputError

__all__ = ["MEGATRON_LM_TOKENIZERS", "GPT2BPETokenizer", "Llama2Tokenizer", "NullTokenizer",
           "build_megatron_tokenizer"]


def _need_file(kind: str, flag: str, path: str | None, what: str) -> str:
    if path is None:
        raise InputError(f"{kind} needs {flag} ({what})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind}: {flag} {path!r} is not a file; pass {what}")
    return path


class _Batched:
    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_packed(self, texts: Sequence[str], dtype=numpy.int32,
                      eod: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        # a long text is encoded whole: these are Megatron-LM's tokenizers, as it runs them
        return pack_texts(texts, self._encode_arrays, self._encode_whole, dtype, eod)

    def _encode_arrays(self, texts: Sequence[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        return pack(self.encode_batch(texts))

    def _encode_whole(self, text: str):
        yield self._encode_arrays([text])[0]


class Llama2Tokenizer(_Batched):
    """A Llama-2 sentencepiece ``tokenizer.model``: BOS and EOS ids from the model, EOD =
    EOS. With ``legacy`` (``--legacy-tokenizer``) every encoded text starts with BOS, as
    Megatron-LM's legacy ``tokenize`` does; without, the text's ids alone (its default
    tokenizer system)."""

    def __init__(self, model_path: str | None, legacy: bool = False) -> None:
        import sentencepiece

        path = _need_file("Llama2Tokenizer", "--tokenizer-model", model_path,
                          "the Llama-2 sentencepiece tokenizer.model")
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(path)
        except (OSError, RuntimeError) as e:
            raise InputError(f"Llama2Tokenizer: cannot load {path!r} as a sentencepiece model "
                             f"({e}); check --tokenizer-type/--tokenizer-model") from None
        if self._sp.bos_id() < 0 or self._sp.eos_id() < 0:
            raise InputError(f"Llama2Tokenizer: {path!r} has no BOS or no EOS piece, which "
                             "Llama-2 models have; use --tokenizer-type SentencePieceTokenizer")
        self.vocab_size = self._sp.vocab_size()
        self.bos, self.eos, self.pad_id = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        self.eod = self.eos
        # no ``pad``: as for Megatron-LM's tokenizer, megatron-core's datasets then pad with
        # an id no text has (a model's pad id may be a real piece such as <unk>)
        self._first = [self.bos] if legacy else []
        earlier = {"class": "Llama2Tokenizer", "model_sha256": file_sha256(path),
                   "vocab_size": self.vocab_size}
        self.unique_identifiers = {**earlier, "ids": LEGACY_IDS if legacy else MEGATRON_CORE_IDS}
        # Llama2Tokenizer's ids here had BOS first before it took Megatron-LM's default
        self.earlier_record = EarlierRecord(
            earlier, same_ids=legacy, kind="Llama2Tokenizer", legacy=True,
            fix="that run's data has Llama2Tokenizer's earlier ids here, BOS before every "
                "document, which --legacy-tokenizer gives; pass --legacy-tokenizer, or "
                "preprocess the data again and start a new run")

    def encode(self, text: str) -> list[int]:
        return self._first + self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # one thread: preprocessing workers give the parallelism
        return [self._first + ids for ids in self._sp.Encode(list(texts), num_threads=1)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.DecodeIds(list(ids))


class GPT2BPETokenizer(_Batched):
    """GPT-2's byte-level BPE from ``vocab.json`` and ``merges.txt``; EOD is
    ``<|endoftext|>``. As in Megatron-LM, text is never split at special tokens: the
    string "<|endoftext|>" in a document is encoded as its characters."""

    EOD_TEXT = "<|endoftext|>"

    def __init__(self, vocab_file: str | None, merge_file: str | None) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        vocab = _need_file("GPT2BPETokenizer", "--vocab-file", vocab_file, "GPT-2's vocab.json")
        merges = _need_file("GPT2BPETokenizer", "--merge-file", merge_file, "GPT-2's merges.txt")
        try:
            with open(vocab, encoding="utf-8") as f:
                table = json.load(f)
            self._tok = Tokenizer(models.BPE.from_file(vocab, merges))
        except Exception as e:  # the library raises plain Exception on bad files
            raise InputError(f"GPT2BPETokenizer: cannot read --vocab-file {vocab!r} with "
                             f"--merge-file {merges!r} ({e})") from None
        # GPT-2's pre-tokenizer: its regex over bytes mapped to printable characters
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        if self.EOD_TEXT not in table:
            raise InputError(f"GPT2BPETokenizer: {vocab!r} has no {self.EOD_TEXT} token to end "
                             "documents with")
        self.vocab_file, self.merge_file = vocab, merges  # HF export copies them
        self.vocab_size = len(table)
        self.eod = self.eos = table[self.EOD_TEXT]
        self.unique_identifiers = {"class": "GPT2BPETokenizer",
                                   "vocab_sha256": file_sha256(vocab),
                                   "merges_sha256": file_sha256(merges),
                                   "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


class NullTokenizer(_Batched):
    """Text that is already ids: "12 7 3" encodes to [12, 7, 3]. ``vocab_size`` is
    ``--vocab-size`` + 1: the last id is EOD (Megatron-LM's rule)."""

    def __init__(self, vocab_size: int | None) -> None:
        if vocab_size is None or vocab_size < 1:
            raise InputError("NullTokenizer needs --vocab-size (the ids below the end-of-document "
                             "id, which is --vocab-size itself)")
        self.vocab_size = vocab_size + 1
        self.eod = self.eos = vocab_size
        self.unique_identifiers = {"class": "NullTokenizer", "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split(" ")]
        except ValueError:
            raise InputError("NullTokenizer: the text is not integers separated by single "
                             f"spaces: {text[:40]!r}") from None
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise InputError(f"NullTokenizer: an id is outside 0..{self.vocab_size - 1}: "
                             f"{text[:40]!r}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(i) for i in ids)


def build_megatron_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                             vocab_size: int | None = None, vocab_file: str | None = None,
                             merge_file: str | None = None, legacy: bool = False):
    """One of ``MEGATRON_LM_TOKENIZERS`` from Megatron-LM's flags. GPT2BPETokenizer takes
    --vocab-file and --merge-file, or a --tokenizer-model directory holding vocab.json and
    merges.txt; ``legacy`` (--legacy-tokenizer) changes Llama2Tokenizer's ids only. Raises
    FileNotFoundError or ValueError naming the flag."""
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model, legacy)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        if (vocab_file is None and merge_file is None and tokenizer_model
                and os.path.isdir(tokenizer_model)):
            vocab_file = os.path.join(tokenizer_model, "vocab.json")
            merge_file = os.path.join(tokenizer_model, "merges.txt")
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise InputError(f"--tokenizer-type {tokenizer_type!r}: not one of {MEGATRON_LM_TOKENIZERS}")
