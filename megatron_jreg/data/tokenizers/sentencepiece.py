"""A sentencepiece ``.model`` as Megatron-LM core_v0.16.1 runs it under
``SentencePieceTokenizer``, ``GPTSentencePieceTokenizer`` (and, with ``--legacy-tokenizer``,
its legacy special tokens); ``tokenizers.build`` builds it. Imports neither torch nor
megatron-core: preprocessing workers import it.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import numpy

from megatron_jreg.data.tokenizers.records import LEGACY_IDS, MEGATRON_CORE_IDS, EarlierRecord
from megatron_jreg.data.tokenizers.token_arrays import file_sha256, pack, pack_texts, space_cuts
from megatron_jreg.errors import InputError


class SentencePieceTokenizer:
    """A sentencepiece ``.model`` file (Llama-2 style), as Megatron-LM core_v0.16.1 runs it
    under ``kind`` (``SENTENCEPIECE_TOKENIZERS``):

    - ``GPTSentencePieceTokenizer``, and ``SentencePieceTokenizer`` without ``legacy``
      (Megatron-LM's default tokenizer system): the model's ids as they are, EOD its EOS.
    - ``SentencePieceTokenizer`` with ``legacy`` (``--legacy-tokenizer``): Megatron-LM's
      legacy special tokens ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>`` and the pad, BOS and
      EOS pieces (each added after the model's ids unless the model has it); a text is split
      at these tokens' strings, each one id; EOD is ``<EOD>``.

    ``SentencePieceTokenizer``'s vocabulary counts the added tokens in both modes:
    Megatron-LM sizes its model from the legacy tokenizer whatever ids the data holds."""

    def __init__(self, model_path: str, kind: str = "SentencePieceTokenizer",
                 legacy: bool = False) -> None:
        import sentencepiece

        if not os.path.isfile(model_path):
            raise FileNotFoundError(
                f"{kind}: --tokenizer-model {model_path!r} is not a file; "
                f"pass a sentencepiece .model (tools/train_tokenizer.py makes one)"
            )
        self._sp = sentencepiece.SentencePieceProcessor()
        try:
            self._sp.Load(model_path)
        except (OSError, RuntimeError) as e:
            raise InputError(
                f"{kind}: cannot load {model_path!r} as a sentencepiece model "
                f"({e}); check --tokenizer-type/--tokenizer-model"
            ) from None
        if self._sp.eos_id() < 0:
            raise InputError(
                f"{kind}: {model_path!r} has no EOS piece to mark document ends; "
                f"retrain it with eos_id set (tools/train_tokenizer.py does)"
            )
        self._numpy_out = _sentencepiece_has_numpy(self._sp)
        self._cuts_at_spaces = _sentencepiece_cuts_at_spaces(self._sp)
        pieces = self._sp.vocab_size()
        # the legacy special tokens: counted in the vocabulary of SentencePieceTokenizer,
        # split out of the text only with --legacy-tokenizer
        self._special = (_legacy_special_tokens(self._sp) if kind == "SentencePieceTokenizer"
                         else {})
        self._splits = legacy and bool(self._special)
        self._split_pattern = re.compile("|".join(map(re.escape, self._special)))
        self.vocab_size = max([pieces - 1, *self._special.values()]) + 1
        self.eod = self._special["<EOD>"] if self._splits else self._sp.eos_id()
        self.eos = self._sp.eos_id()
        self.bos = self._sp.bos_id()
        sha = file_sha256(model_path)
        self.unique_identifiers = {"class": kind, "model_sha256": sha,
                                   "vocab_size": self.vocab_size}
        if self._special:
            self.unique_identifiers["ids"] = LEGACY_IDS if legacy else MEGATRON_CORE_IDS
        # what this project recorded for this file before SentencePieceTokenizer took
        # Megatron-LM's meaning: the ids GPTSentencePieceTokenizer gives now
        self.earlier_record = EarlierRecord(
            {"class": "SentencePieceTokenizer", "model_sha256": sha, "vocab_size": pieces},
            same_ids=not self._special, kind="GPTSentencePieceTokenizer", legacy=False,
            fix=(f"that run used SentencePieceTokenizer's earlier meaning here, sentencepiece's "
                 f"{pieces} ids and no added tokens, which is GPTSentencePieceTokenizer now; "
                 "pass --tokenizer-type GPTSentencePieceTokenizer"))

    def split_tokens(self) -> dict[str, int]:
        """The special tokens a text is split at, one id each ({} unless
        ``--legacy-tokenizer`` gives SentencePieceTokenizer's legacy ids)."""
        return dict(self._special) if self._splits else {}

    def encode(self, text: str) -> list[int]:
        if self._splits:
            return self._encode_split(text)
        return self._sp.EncodeAsIds(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._splits:
            return [self._encode_split(t) for t in texts]
        # One thread: parallelism comes from preprocessing workers, and sentencepiece's
        # own thread pool would oversubscribe the cores they use.
        return self._sp.Encode(list(texts), num_threads=1)

    def _encode_split(self, text: str) -> list[int]:
        """Megatron-LM's legacy ids: the text cut at the first special token's string (the
        earliest; of two at one place, the one added first: the pattern's alternatives are
        in that order), the text before it encoded, the token one id; again from after it.
        One scan of the text, however many tokens it holds."""
        ids: list[int] = []
        start = 0
        for match in self._split_pattern.finditer(text):
            ids += self._sp.EncodeAsIds(text[start:match.start()])
            ids.append(self._special[match.group()])
            start = match.end()
        return ids + self._sp.EncodeAsIds(text[start:])

    def encode_packed(self, texts: Sequence[str], dtype=numpy.int32,
                      eod: int | None = None) -> tuple[numpy.ndarray, numpy.ndarray]:
        """``encode_batch`` as (ids concatenated in ``dtype``, each text's followed by
        ``eod`` when given; ids per text)."""
        return pack_texts(texts, self._encode_arrays, self._encode_long, dtype, eod)

    def _encode_arrays(self, texts: Sequence[str]) -> tuple[numpy.ndarray, numpy.ndarray]:
        if self._splits or not self._numpy_out:
            return pack(self.encode_batch(texts))
        # Arrays straight from C++: no Python int per token.
        arrays = self._sp.Encode(list(texts), num_threads=1, out_type="numpy")
        lengths = numpy.fromiter(map(len, arrays), numpy.int32, count=len(arrays))
        ids = numpy.concatenate(arrays) if arrays else numpy.zeros(0, numpy.int32)
        return ids, lengths

    def _encode_long(self, text: str):
        if self._splits or not self._cuts_at_spaces:  # Megatron-LM's legacy path: whole
            yield self._encode_arrays([text])[0]
            return
        # The space is dropped at a cut: the next piece's dummy prefix is that space.
        for piece in space_cuts(text, keep_space=False):
            yield self._encode_arrays([piece])[0]

    def decode(self, ids: Sequence[int]) -> str:
        added = {i: t for t, i in self._special.items() if i >= self._sp.vocab_size()}
        if not added:
            return self._sp.DecodeIds(list(ids))
        # the added tokens (ids past the model's pieces) as their text
        text, run = [], []
        for i in ids:
            if i in added:
                text += [self._sp.DecodeIds(run), added[i]]
                run = []
            else:
                run.append(i)
        return "".join(text) + self._sp.DecodeIds(run)


def _legacy_special_tokens(sp) -> dict[str, int]:
    """Megatron-LM's legacy ``SentencePieceTokenizer`` special tokens, in the order it adds
    them, and their ids: ``<CLS>``, ``<SEP>``, ``<EOD>``, ``<MASK>``, then the model's pad,
    BOS and EOS pieces (``<PAD>``, ``<BOS>``, ``<EOS>`` where the model has none); a token
    the model has keeps its id, any other takes the next id after the model's."""
    vocab = {sp.id_to_piece(i): i for i in range(sp.vocab_size())}
    next_id = len(vocab)
    special: dict[str, int] = {}

    def piece(piece_id: int, fallback: str) -> str:
        try:
            return sp.id_to_piece(piece_id)
        except IndexError:  # no such piece (id -1)
            return fallback

    for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", piece(sp.pad_id(), "<PAD>"),
                  piece(sp.bos_id(), "<BOS>"), piece(sp.eos_id(), "<EOS>")):
        if token not in vocab:
            vocab[token] = next_id
            next_id += 1
        special[token] = vocab[token]
    return special


# Normalisations that leave ASCII letters, digits and a space between them as they are.
_LOCAL_NORMALIZATIONS = ("identity", "nfkc", "nmt_nfkc", "nfkc_cf", "nmt_nfkc_cf")


def _sentencepiece_cuts_at_spaces(sp) -> bool:
    """Whether encoding "... x" and "y ..." apart gives the ids of "... x y ..." (x, y ASCII
    letters or digits): the space starts a word (split by whitespace, no piece holds U+2581
    after other characters) and each text starts with a dummy-prefix space. Else long texts
    are encoded whole."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # needs protobuf
        return False
    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(sp.serialized_model_proto())
    norm, trainer = model.normalizer_spec, model.trainer_spec
    if not (norm.add_dummy_prefix and norm.escape_whitespaces
            and norm.name in _LOCAL_NORMALIZATIONS and trainer.split_by_whitespace
            and not trainer.treat_whitespace_as_suffix):
        return False
    return not any("\u2581" in piece.piece.lstrip("\u2581") for piece in model.pieces)


def _sentencepiece_has_numpy(sp) -> bool:
    """Whether this sentencepiece encodes to numpy arrays (older releases do not)."""
    try:
        sp.Encode([""], num_threads=1, out_type="numpy")
    except (ValueError, TypeError, RuntimeError):
        return False
    return True
