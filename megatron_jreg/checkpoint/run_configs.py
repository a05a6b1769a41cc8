"""A checkpoint's run for the tools, read without building a model: the iterations to
open (the catalog's choice, read through the trusted open and the descriptor), the
embedding rows checked against the run config, and the tokenizer the run trained with.
:mod:`model_loader` builds the model.
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Optional

from megatron_jreg.checkpoint import catalog, formats
from megatron_jreg.data.tokenizers.build import (
    build_tokenizer,
    describe_tokenizer,
    tokenizer_identity,
)
from megatron_jreg.data.tokenizers.records import earlier_record_fix, holds_same_ids
from megatron_jreg.errors import InputError

# the pinned-tokenizer warnings already printed in this process (each is said once)
_WARNED: set = set()


def checkpoint_sources(
    root: str,
    iteration: Optional[int] = None,
    iterations: Optional[List[int]] = None,
    all_iterations: bool = False,
) -> List[formats.Source]:
    """The iterations of ``root`` to open, each found, opened and described: the latest,
    one, a list, or every whole one. Raises the catalog's and the open's faults (the tools
    phrase them with their flags: faults.TOOLS)."""
    found = catalog.scan(root)
    if all_iterations:
        # none whole: the catalog's choice (Megatron-LM's release/, or the fault saying why)
        chosen: List[Optional[int]] = list(found.whole) or [None]
    elif iterations:
        chosen = list(iterations)
    else:
        chosen = [iteration]
    return [formats.read(root, it, found=found) for it in chosen]


def saved_vocab_rows(source: formats.Source) -> int:
    """Rows of the saved embedding: the padded vocabulary the run was built with."""
    source.opened.require_metadata()
    rows, model_cfg = source.format.embedding_rows, source.format.configs["model"]
    if model_cfg.vocab_size is not None and rows < model_cfg.vocab_size:
        raise InputError(
            f"{source.path}: the embedding has {rows} rows but the run config's vocabulary is "
            f"{model_cfg.vocab_size}; run_config.yaml does not belong to these weights"
        )
    return rows

def launched_world_size() -> int:
    """The number of processes torchrun started (1 for a plain ``python`` run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))

def build_run_tokenizer(configs: Dict[str, object], tokenizer_model: Optional[str] = None):
    """The tokenizer the run trained with (``tokenizer_model`` overrides a moved file).

    Megatron-LM's types come from the same flags the trainer read: GPT2BPETokenizer from the
    run's ``--vocab-file``/``--merge-file`` (a ``tokenizer_model`` override is the directory
    now holding vocab.json and merges.txt), NullTokenizer from the saved vocabulary, which
    counts its EOD (the trainer saves ``--vocab-size`` + 1).
    """
    data = configs["data"]
    kind = data.tokenizer_type
    model_file = tokenizer_model or data.tokenizer_model
    kwargs: Dict[str, object] = {}
    fix = "if the tokenizer file moved, pass its new path with --tokenizer-model"
    if kind in ("ByteTokenizer", "NullTokenizer"):
        model_file = None
        fix = "run_config.yaml does not describe this run's tokenizer"
    if kind == "NullTokenizer":
        saved = configs["model"].vocab_size
        kwargs["vocab_size"] = None if saved is None else int(saved) - 1
    elif kind == "GPT2BPETokenizer":
        fix = ("if vocab.json and merges.txt moved, pass the directory holding them with "
               "--tokenizer-model")
        if tokenizer_model is None:
            kwargs["vocab_file"] = getattr(data, "vocab_file", None)
            kwargs["merge_file"] = getattr(data, "merge_file", None)
        elif not os.path.isdir(tokenizer_model):
            raise InputError(
                f"--tokenizer-model {tokenizer_model}: a GPT2BPETokenizer run needs the "
                "directory holding its vocab.json and merges.txt"
            )
    legacy = bool(getattr(data, "legacy_tokenizer", False))
    try:
        tokenizer = build_tokenizer(kind, model_file, legacy=legacy, **kwargs)
        pinned = getattr(data, "tokenizer_identity", None)
        if earlier_record_fix(tokenizer, pinned):
            # a run saved before records named their ids: the tokenizer that gives its ids
            earlier = tokenizer.earlier_record
            tokenizer = build_tokenizer(earlier.kind, model_file, legacy=earlier.legacy, **kwargs)
    except (FileNotFoundError, ValueError) as err:
        raise InputError(f"cannot build the run's {kind} ({err}); {fix}") from None
    _check_pinned(configs, tokenizer, model_file, tokenizer_model)
    return tokenizer

def _check_pinned(configs, tokenizer, model_file, override: Optional[str]) -> None:
    """The tokenizer built must be the one the run trained with (its saved identity): a
    file retrained in place is refused; one passed with --tokenizer-model is used as
    asked, said once."""
    data, vocab = configs["data"], configs["model"].vocab_size
    pinned = getattr(data, "tokenizer_identity", None)
    now = tokenizer_identity(tokenizer)
    if not pinned or holds_same_ids(tokenizer, pinned):
        return
    was = describe_tokenizer(data.tokenizer_type, vocab, pinned)
    got = describe_tokenizer(data.tokenizer_type, tokenizer.vocab_size, now)
    if override is None:
        raise InputError(
            f"the run's tokenizer {model_file} is now {got}, not the {was} the run trained with; "
            "pass that tokenizer with --tokenizer-model (or this one, to use it anyway)")
    message = (f"--tokenizer-model {override}: {got} is not the {was} the run trained with; "
               "using it as asked")
    if message not in _WARNED:
        _WARNED.add(message)
        print(f"warning: {message}", file=sys.stderr, flush=True)
