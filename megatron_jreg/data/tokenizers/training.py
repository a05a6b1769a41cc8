"""Train a small Llama-2-style sentencepiece model on a local corpus, so demos need no download."""

from __future__ import annotations

import io
import json
import os
import random
import re
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from megatron_jreg.atomic_write import (
    check_output_path,
    write_atomic,
    write_text_atomic,
)
from megatron_jreg.config.values import check_fields
from megatron_jreg.data.preprocess.sources import resolve_inputs
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import output_lock

# The smallest --max-sentences: the bound of sentencepiece's own sampling (its
# input_sentence_size refuses 1 to 100), kept for the sample drawn here.
_MIN_SENTENCES = 101
# sentencepiece skips a line longer than this many bytes; such lines are left out before
# sampling, so that every sampled line is trained on.
_MAX_LINE_BYTES = 16384


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
    """The most lines trained on, which bounds memory on big corpora: an input with more
    lines is sampled uniformly (reservoir sampling seeded by ``--seed``), the lines kept in
    input order. At least 101."""
    model_type: str = field(default="bpe", metadata={"choices": ("bpe", "unigram")})
    """``bpe`` (Llama-2) or ``unigram``."""
    seed: int = 1234
    """Seed of the sample of ``--max-sentences`` lines: the same input, seed and flags train
    the same model. Unused when the input has no more lines than that."""
    overwrite: bool = False
    """Replace an existing ``<model_prefix>.model``/``.vocab`` (checkpoints trained with the
    old tokenizer would be read with the new one)."""

    def __post_init__(self) -> None:
        check_fields(self)  # --max-sentences' bounds, however the config is built
        if self.vocab_size < 300:
            raise InputError(
                f"--vocab-size {self.vocab_size} is too small: 259 ids go to bytes and specials; "
                f"use at least 300"
            )
        if self.input_format not in ("jsonl", "text"):
            raise InputError(f"--input-format must be jsonl or text, got {self.input_format!r}")
        if self.model_type not in ("bpe", "unigram"):
            raise InputError(f"--model-type must be bpe or unigram, got {self.model_type!r}")
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


@dataclass(kw_only=True)
class LineSample:
    """The lines a tokenizer is trained on, and how they were drawn from the input."""

    lines: list[str]
    """The sampled lines, in input order."""
    total: int
    """Lines of the input that could be sampled (non-empty, not too long)."""
    too_long: int = 0
    """Lines left out for being longer than sentencepiece's limit (16384 bytes)."""

    @property
    def sampled(self) -> bool:
        """True when some usable lines were left out of the sample."""
        return len(self.lines) < self.total


def sample_lines(lines: Iterable[str], size: int, seed: int) -> LineSample:
    """``size`` lines drawn uniformly without replacement (Algorithm R, ``random.Random(seed)``),
    returned in input order; every line when there are no more than ``size``. Holds at most
    ``size`` lines at a time."""
    if size < 1:
        raise InputError(f"sample_lines: size must be >= 1, got {size}")
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    total = too_long = 0
    for line in lines:
        if len(line.encode("utf-8")) > _MAX_LINE_BYTES:
            too_long += 1
            continue
        if total < size:
            reservoir.append((total, line))
        else:
            slot = rng.randrange(total + 1)  # keep the line with probability size / (total + 1)
            if slot < size:
                reservoir[slot] = (total, line)
        total += 1
    reservoir.sort(key=lambda item: item[0])
    return LineSample(lines=[line for _, line in reservoir], total=total, too_long=too_long)


@dataclass(kw_only=True)
class TrainedTokenizer:
    """What :func:`train_tokenizer` wrote and the lines it trained on."""

    model_path: str
    sample: LineSample

    def summary(self, config: TrainTokenizerConfig) -> str:
        """One line: the file, the vocabulary and the lines trained on."""
        sample = self.sample
        if sample.sampled:
            lines = (f"{len(sample.lines)} of {sample.total} lines, sampled with --seed "
                     f"{config.seed}")
        else:
            lines = f"all {sample.total} lines"
        if sample.too_long:
            lines += f"; {sample.too_long} lines over {_MAX_LINE_BYTES} bytes left out"
        return f"wrote {self.model_path} (vocab {config.vocab_size}; trained on {lines})"


def _output_paths(config: TrainTokenizerConfig) -> list[str]:
    return [config.model_prefix + ".model", config.model_prefix + ".vocab"]


def train_sentencepiece(config: TrainTokenizerConfig) -> str:
    """Train and write the model (see :func:`train_tokenizer`); returns the ``.model`` path."""
    return train_tokenizer(config).model_path


def train_tokenizer(config: TrainTokenizerConfig) -> TrainedTokenizer:
    """Train and write the model, holding the lock of ``--model-prefix`` (one writer). An
    existing model is kept unless ``overwrite``."""
    with output_lock(config.model_prefix, "--model-prefix"):
        if not config.overwrite:
            for path in _output_paths(config):
                if os.path.exists(path):
                    raise InputError(f"{path} already exists; pass --overwrite to replace it "
                                     "or choose another --model-prefix")
        return _train_and_write(config)


def _too_few_pieces(config: TrainTokenizerConfig, sample: LineSample, most: str) -> InputError:
    if sample.sampled:
        lines = (f"the {len(sample.lines)} lines sampled (--max-sentences "
                 f"{config.max_sentences}) from {sample.total}")
        more = "a larger --max-sentences or more text"
    else:
        lines = f"all {sample.total} lines of the input (--max-sentences {config.max_sentences})"
        more = "more text"
    return InputError(f"--vocab-size {config.vocab_size}: {lines} yield only {most} pieces; "
                      f"use --vocab-size {most} or less, or {more}")


def _train_and_write(config: TrainTokenizerConfig) -> TrainedTokenizer:
    import sentencepiece

    sample = sample_lines(_training_lines(config), config.max_sentences, config.seed)
    model = io.BytesIO()
    try:
        _train(sentencepiece, config, sample.lines, model)
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
            raise _too_few_pieces(config, sample, most.group(1)) from None
        raise InputError(f"sentencepiece cannot train on this input: {reason}") from None
    # Written under a temp name so an interrupted run never leaves a truncated model.
    model_path, vocab_path = _output_paths(config)

    def write_model(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(model.getvalue())

    write_atomic(model_path, write_model)
    _write_vocab(model_path, vocab_path)
    return TrainedTokenizer(model_path=model_path, sample=sample)


def _train(sentencepiece, config: TrainTokenizerConfig, lines: list[str], model) -> None:
    """Train on exactly ``lines``: sentencepiece neither samples nor shuffles them (its own
    sampling draws from a random source no seed reaches)."""
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
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
        input_sentence_size=0,  # every line given
        shuffle_input_sentence=False,
        max_sentence_length=_MAX_LINE_BYTES,
        minloglevel=2,
    )


def _write_vocab(model_path: str, vocab_path: str) -> None:
    """The human-readable ``piece<TAB>score`` list sentencepiece writes beside a model."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
    write_text_atomic(vocab_path, "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i)}\n"
                                          for i in range(sp.vocab_size())))
