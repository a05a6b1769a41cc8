"""The one tokenizer interface used by preprocessing, the trainer and eval_jump.

:func:`build_tokenizer` builds any ``--tokenizer-type`` (Megatron-LM's own types through
``tokenizers.megatron_lm``). Every tokenizer exposes ``vocab_size``, ``eod``, ``encode``,
``encode_batch``, ``encode_packed``, ``decode`` and a JSON-able ``unique_identifiers``: all that
megatron-core's ``GPTDataset`` reads from ``config.tokenizer``, so these objects go to it
directly. ``encode`` never adds BOS/EOS (documents end with the EOD that ``--append-eod``
appends). Imports neither megatron-core nor torch: preprocessing workers import it.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy

from megatron_jreg.config.tokenizer_names import (
    MEGATRON_LM_TOKENIZERS,
    SENTENCEPIECE_TOKENIZERS,
    tokenizer_type_error,
)
from megatron_jreg.data.tokenizers.megatron_lm import build_megatron_tokenizer
from megatron_jreg.data.tokenizers.records import (
    LEGACY_IDS,
    MEGATRON_CORE_IDS,
    EarlierRecord,
    identity,
)
from megatron_jreg.data.tokenizers.sentencepiece import SentencePieceTokenizer
from megatron_jreg.data.tokenizers.token_arrays import (  # noqa: F401 (pack: the callers' import)
    LONG_TEXT_CHARS,
    file_sha256,
    pack,
    pack_texts,
    space_cuts,
)
from megatron_jreg.errors import InputError

# Special-token names that end a document, most specific first. Used only when a bare
# tokenizer.json has no tokenizer_config.json beside it to name the EOS token.
_KNOWN_EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes 0-255 plus EOD (256), BOS (257) and PAD (258); needs no file.

    ``vocab_size`` may be raised above 259 to pad the embedding table.
    """

    NUM_BYTES = 256
    EOD = 256
    BOS = 257
    PAD = 258

    def __init__(self, vocab_size: int | None = None) -> None:
        minimum = self.PAD + 1
        if vocab_size is not None and vocab_size < minimum:
            raise InputError(
                f"ByteTokenizer: --vocab-size {vocab_size} is too small; it needs at least "
                f"{minimum} (256 bytes + EOD, BOS, PAD)"
            )
        self.vocab_size = minimum if vocab_size is None else vocab_size
        self.eod = self.EOD
        self.eos = self.EOD
        self.bos = self.BOS
        self.pad = self.PAD
        self.unique_identifiers = {"class": "ByteTokenizer", "vocab_size": self.vocab_size}

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def encode_packed(self, texts: Sequence[str], dtype=numpy.uint8,
                      eod: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``encode_batch`` as (ids concatenated in ``dtype``, each text's followed by
        ``eod`` when given; ids per text); no Python int per byte."""
        return pack_texts(texts, self._encode_arrays, self._encode_long, dtype, eod)

    @staticmethod
    def _encode_arrays(texts: Sequence[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        raw = [t.encode("utf-8") for t in texts]
        lengths = numpy.fromiter(map(len, raw), numpy.int32, count=len(raw))
        return numpy.frombuffer(b"".join(raw), numpy.uint8), lengths

    @staticmethod
    def _encode_long(text: str):
        # bytes do not depend on their neighbours: any cut gives the same ids
        for start in range(0, len(text), LONG_TEXT_CHARS):
            yield numpy.frombuffer(text[start:start + LONG_TEXT_CHARS].encode("utf-8"),
                                   numpy.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < self.NUM_BYTES).decode("utf-8", errors="replace")


def _hf_eos_token(tokenizer_dir: str | None, special_tokens: dict[str, int], path: str) -> str:
    """The EOS token's text: tokenizer_config.json when present, else a well-known name."""
    config_path = os.path.join(tokenizer_dir, "tokenizer_config.json") if tokenizer_dir else None
    if config_path and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    for name in _KNOWN_EOS_TOKENS:
        if name in special_tokens:
            return name
    raise InputError(
        f"HuggingFaceTokenizer: cannot tell the end-of-document token of {path!r}; put a "
        f"tokenizer_config.json with \"eos_token\" beside tokenizer.json"
    )


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` file or a directory holding one (Llama-3, GPT-2, ...).

    EOD is the tokenizer's EOS token. Without ``legacy`` (Megatron-LM core_v0.16.1's
    default tokenizer system) a text's ids are its own; with ``legacy``
    (``--legacy-tokenizer``) the tokenizer's special tokens are added as its post-processor
    says (Llama 3's BOS before every text), as Megatron-LM's legacy tokenizer does. Uses the
    ``tokenizers`` library directly, so ``transformers`` is not needed.
    """

    def __init__(self, path: str, legacy: bool = False) -> None:
        from tokenizers import Tokenizer

        tokenizer_dir = path if os.path.isdir(path) else os.path.dirname(path) or None
        json_path = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(json_path):
            raise FileNotFoundError(
                f"HuggingFaceTokenizer: no tokenizer.json at {json_path!r}; pass a tokenizer.json "
                f"file or a directory holding one as --tokenizer-model"
            )
        try:
            self._tok = Tokenizer.from_file(json_path)
        except Exception as e:  # the library raises plain Exception on bad files
            raise InputError(
                f"HuggingFaceTokenizer: cannot load {json_path!r} ({e}); check "
                f"--tokenizer-type/--tokenizer-model"
            ) from None
        added = self._tok.get_added_tokens_decoder()
        special = {tok.content: i for i, tok in added.items() if tok.special}
        eos_text = _hf_eos_token(tokenizer_dir, special, json_path)
        eod = self._tok.token_to_id(eos_text)
        if eod is None:
            raise InputError(
                f"HuggingFaceTokenizer: EOS token {eos_text!r} is not in the vocabulary of "
                f"{json_path!r}; fix eos_token in tokenizer_config.json"
            )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = eod
        self.eos = eod
        self._specials = legacy
        # a long text is cut only where no special token is added per piece
        self._cuts_before_spaces = not legacy and _hf_cuts_before_spaces(self._tok)
        self._added_texts = [tok.content for tok in added.values()]
        earlier = {
            "class": "HuggingFaceTokenizer",
            "tokenizer_sha256": file_sha256(json_path),
            "eod": eod,
            "vocab_size": self.vocab_size,
        }
        self.unique_identifiers = {**earlier, "ids": LEGACY_IDS if legacy else MEGATRON_CORE_IDS}
        self.earlier_record = EarlierRecord(
            earlier, same_ids=not legacy, kind="HuggingFaceTokenizer", legacy=False,
            fix="that run's ids had no special tokens added (this tokenizer's default); drop "
                "--legacy-tokenizer")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=self._specials).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets nobody reads here.
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(list(texts), add_special_tokens=self._specials)]

    def encode_packed(self, texts: Sequence[str], dtype=numpy.int32,
                      eod: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``encode_batch`` as (ids concatenated in ``dtype``, each text's followed by
        ``eod`` when given; ids per text)."""
        return pack_texts(texts, self._encode_arrays, self._encode_long, dtype, eod)

    def _encode_arrays(self, texts: Sequence[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        return pack(self.encode_batch(texts))  # the library gives ids only as lists

    def _encode_long(self, text: str):
        if not self._cuts_before_spaces:
            yield self._encode_arrays([text])[0]
            return
        special = self._added_texts
        for piece in _hf_cuts(text, special):
            yield self._encode_arrays([piece])[0]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _hf_cuts_before_spaces(tok) -> bool:
    """Whether encoding "... x" and " y ..." apart gives the ids of "... x y ..." (x, y ASCII
    letters or digits): no normalizer, and GPT-2's byte-level split alone before the model,
    which always starts a word at " y". Else long texts are encoded whole."""
    spec = json.loads(tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True))


def _hf_cuts(text: str, added: list[str]):
    """``space_cuts`` for a Hugging Face tokenizer, but a cut with an added token's text
    near it is dropped: the library finds those before splitting words, and some take the
    whitespace beside them."""
    reach = max(map(len, added), default=0)
    held: list[str] = []
    end = 0
    for piece in space_cuts(text, keep_space=True):
        held.append(piece)
        end += len(piece)
        near = text[max(0, end - reach):end + reach]
        if end < len(text) and any(t and t in near for t in added):
            continue  # keep this piece with the next
        yield held[0] if len(held) == 1 else "".join(held)
        held = []


Tokenizer = ByteTokenizer | SentencePieceTokenizer | HuggingFaceTokenizer


def build_tokenizer(
    tokenizer_type: str,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    legacy: bool = False,
) -> Tokenizer:
    """Build a tokenizer by Megatron-LM's ``--tokenizer-type`` name, from its flags.

    ``vocab_size`` is ByteTokenizer's padded size or NullTokenizer's ``--vocab-size`` (the
    ids below its EOD); ``vocab_file`` and ``merge_file`` are GPT2BPETokenizer's.
    ``legacy`` (``--legacy-tokenizer``) gives the ids of Megatron-LM's legacy tokenizer
    where they differ from its default's (SentencePieceTokenizer, Llama2Tokenizer,
    HuggingFaceTokenizer); every other type gives the same ids either way. Raises
    FileNotFoundError for a missing file and ValueError for anything else the user must
    fix; both messages name the flag.
    """
    error = tokenizer_type_error(tokenizer_type)
    if error:
        raise InputError(error)
    if (vocab_file is not None or merge_file is not None) and tokenizer_type != "GPT2BPETokenizer":
        raise InputError(
            "--vocab-file and --merge-file are GPT2BPETokenizer's files; pass --tokenizer-type "
            "GPT2BPETokenizer (or drop them)"
        )
    if tokenizer_type in ("ByteTokenizer", "NullTokenizer"):
        if tokenizer_model is not None:
            raise InputError(f"{tokenizer_type} needs no file; drop --tokenizer-model")
        if tokenizer_type == "ByteTokenizer":
            return ByteTokenizer(vocab_size)
    elif vocab_size is not None:
        raise InputError(
            f"--vocab-size applies to ByteTokenizer and NullTokenizer only; {tokenizer_type} "
            f"takes its size from its files, so drop --vocab-size"
        )
    if tokenizer_type in MEGATRON_LM_TOKENIZERS:
        return build_megatron_tokenizer(tokenizer_type, tokenizer_model, vocab_size,
                                        vocab_file, merge_file, legacy=legacy)
    if tokenizer_model is None:
        raise InputError(f"{tokenizer_type} needs --tokenizer-model (its model file)")
    if tokenizer_type in SENTENCEPIECE_TOKENIZERS:
        return SentencePieceTokenizer(tokenizer_model, tokenizer_type, legacy)
    return HuggingFaceTokenizer(tokenizer_model, legacy)


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """What pins a run's tokenizer in its saved config: the sha256 of its
    ``unique_identifiers`` (kind, vocabulary size, which ids where a type has two, and its
    files' content hashes; no path), so a moved copy matches and a retrained file at the
    same path does not."""
    return identity(tokenizer.unique_identifiers)


def describe_tokenizer(kind: str, vocab_size: int | None, identity: str | None) -> str:
    """One tokenizer in a message: ``SentencePieceTokenizer (380 ids, 1a2b3c4d5e6f)``."""
    parts = [f"{vocab_size} ids" if vocab_size is not None else None,
             identity[:12] if identity else None]
    inner = ", ".join(p for p in parts if p)
    return f"{kind} ({inner})" if inner else kind
