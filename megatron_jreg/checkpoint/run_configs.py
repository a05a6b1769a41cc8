"""A checkpoint's run, read without building a model: its iterations, the run config of
one iteration directory (``run_config.yaml``: the schema of ``config.run``; for a
checkpoint Megatron-LM saved, the same sections from its ``args``), the tokenizer it
carries or pins, and its embedding rows. Imports neither megatron-core nor the model, so
the trainer's flags (``--use-checkpoint-args``), eval_downstream and the checks before a
load read a checkpoint in a fraction of a second; :mod:`model_loader` builds the model.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Dict, List, Optional

from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.checkpoint.megatron_lm_args import (
    is_megatron_lm_state,
    read_common_state,
    sections_from_args,
)
from megatron_jreg.checkpoint.safe_pickle import UnsafeCheckpointError
from megatron_jreg.config.run import SECTIONS
from megatron_jreg.config.yaml_settings import from_yaml_text
from megatron_jreg.data.tokenizers.build import build_tokenizer, describe_tokenizer, tokenizer_identity
from megatron_jreg.errors import InputError

# the pinned-tokenizer warnings already printed in this process (each is said once)
_WARNED: set = set()

# The flag of eval_jump and convert_to_hf that picks an iteration: the checkpoint module's
# messages name it (the trainer's own flag is --ckpt-step).
ITERATION_FLAG = "--iteration"


def checkpoint_iterations(
    root: str,
    iteration: Optional[int] = None,
    iterations: Optional[List[int]] = None,
    all_iterations: bool = False,
    flag: str = "--load",
) -> List[int]:
    """The iterations of ``root`` to open: the latest, one, a list, or every whole one.

    Checks the directory and that each chosen iteration is whole (its save finished) and
    describes its model (``run_config.yaml``, or Megatron-LM's ``args``); raises InputError
    naming the fix otherwise.
    """
    if not os.path.exists(root):
        raise InputError(f"{flag} {root}: no such directory; check the path")
    if not os.path.isdir(root):
        raise InputError(f"{flag} {root}: not a directory; give the --save directory of a run")
    whole = ckpt.complete_iterations(root)
    name = os.path.basename(os.path.normpath(root))
    if name.startswith("iter_") and ckpt.torn_reason(root) is None:
        it = name[5:].lstrip("0") or "0"
        raise InputError(
            f"{flag} {root}: this is one iteration's directory; give its parent and "
            f"--iteration {it}"
        )
    if not whole:
        left = ckpt.left_whole(root)  # a save killed in its renames left its only copy aside
        if left:
            it = max(left)
            raise InputError(
                f"{flag} {root}: a save of iteration {it} was killed while it was renamed "
                f"into place; its whole copy is {os.path.join(root, left[it])}: rename it to "
                f"iter_{it:07d} (the next training run with --save {root} does so itself)")
        raise InputError(
            f"{flag} {root}: not a torch_dist checkpoint directory (no complete iter_XXXXXXX "
            "directory); give the --save directory of a training run"
        )
    if all_iterations:
        chosen = whole
    elif iterations:
        chosen = list(iterations)
    elif iteration is not None:
        chosen = [iteration]
    elif not os.path.exists(os.path.join(root, ckpt.TRACKER)):
        chosen = [whole[-1]]  # no tracker file (e.g. copied by hand): the newest whole one
    else:
        # the tracker names the latest save: a torn one is an error, not silently skipped
        try:
            chosen = [ckpt.resolve_iteration(root, step_flag=ITERATION_FLAG, root_flag=flag)]
        except ckpt.CheckpointError as err:
            raise InputError(f"{flag} {root}: {err}") from None
    left = ckpt.left_whole(root)  # whole copies a save killed in its renames left
    for it in chosen:
        if it not in whole and it in left:
            raise InputError(
                f"{flag} {root}: a save of iteration {it} was killed while it was renamed "
                f"into place; its whole copy is {os.path.join(root, left[it])}: rename it to "
                f"iter_{it:07d} (the next training run with --save {root} does so itself)")
        if it not in whole:
            raise InputError(
                f"{flag} {root}: iteration {it} is not a complete checkpoint there; "
                f"complete iterations: {whole}"
            )
        path = ckpt.iteration_dir(root, it)
        if not os.path.isfile(os.path.join(path, ckpt.RUN_CONFIG)) and \
                not is_megatron_lm_state(read_common_state(path)):
            raise InputError(
                f"{flag} {root}: {path} has neither {ckpt.RUN_CONFIG} nor Megatron-LM's args "
                "in its common state, so the model cannot be rebuilt; give a checkpoint saved "
                "by this project's trainer or by Megatron-LM"
            )
    return chosen

def read_run_configs(path: str) -> Dict[str, object]:
    """The config sections (model, parallel, data, ...) saved with one iteration directory:
    its ``run_config.yaml``, else those of Megatron-LM's ``args`` (a checkpoint Megatron-LM
    saved: the architecture, layout, tokenizer and seed; the rest defaults)."""
    text = ckpt.read_run_config(path)
    if text is None:
        common = read_common_state(path)
        if is_megatron_lm_state(common):
            return sections_from_args(common["args"], path)
        raise InputError(f"{path}: neither {ckpt.RUN_CONFIG} nor Megatron-LM's args; cannot "
                         "rebuild the model")
    try:
        configs = from_yaml_text(text, SECTIONS)
    except Exception as err:  # yaml errors, unknown keys (TypeError), validation (ValueError)
        raise InputError(
            f"{os.path.join(path, ckpt.RUN_CONFIG)}: cannot rebuild the run config "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    carried = carried_tokenizer(path)
    if carried and configs["data"].tokenizer_type == "HuggingFaceTokenizer":
        # the files the run used, wherever it moved
        configs["data"] = dataclasses.replace(configs["data"], tokenizer_model=carried)
    return configs

def carried_tokenizer(path: str) -> Optional[str]:
    """The Hugging Face tokenizer directory saved inside iteration directory ``path``
    (an imported model's, and every save of a HuggingFaceTokenizer run), or None."""
    carried = os.path.join(path, ckpt.TOKENIZER_DIR)
    return carried if os.path.isfile(os.path.join(carried, "tokenizer.json")) else None

def saved_vocab_rows(path: str, model_cfg) -> int:
    """Rows of the saved embedding: the padded vocabulary the run was built with."""
    try:
        rows = ckpt.saved_embedding_rows(path, step_flag=ITERATION_FLAG)
    except UnsafeCheckpointError:  # its fix is a trusted rebuild, not another iteration
        raise
    except ckpt.CheckpointError as err:
        message = str(err)
        if ITERATION_FLAG not in message:
            message += f"; pick another {ITERATION_FLAG}"
        raise InputError(message) from None
    if model_cfg.vocab_size is not None and rows < model_cfg.vocab_size:
        raise InputError(
            f"{path}: the embedding has {rows} rows but the run config's vocabulary is "
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
    try:
        tokenizer = build_tokenizer(kind, model_file, **kwargs)
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
    if not pinned or now == pinned:
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
