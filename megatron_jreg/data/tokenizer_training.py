"""Train a small Llama-2-style sentencepiece model on a local corpus, so demos need no download."""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

from megatron_jreg.atomic_write import (
    check_output_path,
    output_lock,
    write_atomic,
    write_text_atomic,
)
from megatron_jreg.config_values import check_fields
from megatron_jreg.data.text_sources import resolve_inputs
from megatron_jreg.errors import InputError


# sentencepiece refuses an input_sentence_size of 1 to 100 with an internal check message; 0
# (its "every line") is no number of sentences to sample either.
_MIN_SENTENCES = 101


@dataclass(kw_only=True)
class TrainTokenizerConfig:
    """A sentencepiece BPE model with byte fallback, ids unk=0, bos=1, eos=2 like Llama-2."""

    input: list[str]
    """JSONL files (or text with ``--input-format text``), globs or directories."""
    model_prefix: str
    """Writes ``<model_prefix>.model`` and ``<model_prefix>.vocab``."""
    vocab_size: int = 3000
    """Small vocabularies train in seconds; 256 byte pieces and 3 specials are included."""
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    """JSON keys whose strings are training text."""
    input_format: str = field(default="jsonl", metadata={"choices": ("jsonl", "text")})
    """``jsonl`` or ``text`` (one document per line)."""
    max_sentences: int = field(default=2_000_000, metadata={"min": _MIN_SENTENCES})
    """Lines sampled for training; bounds memory on big corpora. sentencepiece samples no
    fewer than 101 (its ``input_sentence_size`` takes 0 for "every line" or more than 100)."""
    model_type: str = field(default="bpe", metadata={"choices": ("bpe", "unigram")})
    """``bpe`` (Llama-2) or ``unigram``."""
    seed: int = 1234
    """Sampling seed, for reproducible models."""
    overwrite: bool = False
    """Replace an existing ``<model_prefix>.model``/``.vocab`` (checkpoints trained with the
    old tokenizer would be read with the new one)."""

    def __post_init__(self) -> None:
        check_fields(self)  # --max-sentences' bounds, however the config is built
        if self.vocab_size < 300:
            raise ValueError(
                f"--vocab-size {self.vocab_size} is too small: 259 ids go to bytes and specials; "
                f"use at least 300"
            )
        if self.input_format not in ("jsonl", "text"):
            raise ValueError(f"--input-format must be jsonl or text, got {self.input_format!r}")
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"--model-type must be bpe or unigram, got {self.model_type!r}")
        check_output_path(self.model_prefix + ".model", "--model-prefix")


def _training_lines(config: TrainTokenizerConfig) -> Iterator[str]:
    """Non-empty lines of every document; sentencepiece treats each line as a sentence."""
    for path in resolve_inputs(config.input, config.input_format):
        with path.open_text() as f:
            for line in f:
                if config.input_format == "text":
                    texts = [line]
                else:
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    texts = [record[k] for k in config.json_keys if isinstance(record.get(k), str)]
                for text in texts:
                    for piece in text.split("\n"):
                        if piece.strip():
                            yield piece


def _output_paths(config: TrainTokenizerConfig) -> list[str]:
    return [config.model_prefix + ".model", config.model_prefix + ".vocab"]


def train_sentencepiece(config: TrainTokenizerConfig) -> str:
    """Train and write the model, holding the lock of ``--model-prefix`` (one writer);
    returns the ``.model`` path. An existing model is kept unless ``overwrite``."""
    with output_lock(config.model_prefix, "--model-prefix"):
        if not config.overwrite:
            for path in _output_paths(config):
                if os.path.exists(path):
                    raise InputError(f"{path} already exists; pass --overwrite to replace it "
                                     "or choose another --model-prefix")
        return _train_and_write(config)


def _train_and_write(config: TrainTokenizerConfig) -> str:
    import sentencepiece

    # Seeds sentence sampling and shuffling, so retraining gives the same model.
    sentencepiece.set_random_generator_seed(config.seed)
    model = io.BytesIO()
    try:
        _train(sentencepiece, config, model)
    except RuntimeError as err:  # sentencepiece reports bad settings as RuntimeError
        reason = str(err).strip().splitlines()[0]
        need = re.search(r"required_chars\. \d+ vs (\d+)", reason)
        if need:
            raise InputError(f"--vocab-size {config.vocab_size}: too small for this text, whose "
                             f"characters alone need {need.group(1)} pieces; use --vocab-size "
                             f"{need.group(1)} or more") from None
        most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)",
                         reason)
        if most:  # the sample (or the whole text) yields fewer pieces than asked
            raise InputError(f"--vocab-size {config.vocab_size}: the lines sampled (at most "
                             f"--max-sentences {config.max_sentences}) yield only {most.group(1)} "
                             f"pieces; use --vocab-size {most.group(1)} or less, or a larger "
                             "--max-sentences or more text") from None
        raise InputError(f"sentencepiece cannot train on this input: {reason}") from None
    # Written under a temp name so an interrupted run never leaves a truncated model.
    model_path, vocab_path = _output_paths(config)

    def write_model(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(model.getvalue())

    write_atomic(model_path, write_model)
    _write_vocab(model_path, vocab_path)
    return model_path


def _train(sentencepiece, config: TrainTokenizerConfig, model) -> None:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_training_lines(config),
        model_writer=model,
        vocab_size=config.vocab_size,
        model_type=config.model_type,
        # Llama-2's choices: raw text kept as is, digits split, unknown bytes never lost.
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        character_coverage=0.9999,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=config.max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=16384,
        minloglevel=2,
    )


def _write_vocab(model_path: str, vocab_path: str) -> None:
    """The human-readable ``piece<TAB>score`` list sentencepiece writes beside a model."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    write_text_atomic(vocab_path, "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n"
                                          for i in range(sp.vocab_size())))
