"""Open one iteration of a megatron-jreg checkpoint as a model, at any TP/PP layout.

Shared by ``eval_jump --load`` (one process, or under torchrun) and
``tools/convert_to_hf.py``. The run's resolved config (``run_config.yaml`` in the iteration
directory) rebuilds the model at the requested TP/PP; dist-checkpointing reshards the
weights from whatever TP/PP/VPP layout wrote them. One process is the TP1 PP1 DP1 case of
a torchrun world. The model is built with the embedding's row count as saved (read from
the checkpoint's metadata), not re-padded: checkpoints of earlier versions padded the
vocabulary per TP size.

Everything a user can get wrong (paths, torn saves, a layout that does not fit, a moved
tokenizer) raises :class:`InputError` before any weights are read where it can.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron_jreg.checkpoint import dist_checkpoint as ckpt
from megatron_jreg.errors import InputError

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
    carries ``run_config.yaml``; raises InputError naming the fix otherwise.
    """
    if not os.path.exists(root):
        raise InputError(f"{flag} {root}: no such directory; check the path")
    if not os.path.isdir(root):
        raise InputError(f"{flag} {root}: not a directory; give the --save directory of a run")
    whole = ckpt.complete_iterations(root)
    if os.path.exists(os.path.join(root, ckpt.COMPLETE)):
        it = os.path.basename(os.path.normpath(root))[5:].lstrip("0") or "0"
        raise InputError(
            f"{flag} {root}: this is one iteration's directory; give its parent and "
            f"--iteration {it}"
        )
    if not whole:
        raise InputError(
            f"{flag} {root}: not a megatron-jreg checkpoint directory (no complete iter_XXXXXXX "
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
    for it in chosen:
        if it not in whole:
            raise InputError(
                f"{flag} {root}: iteration {it} is not a complete checkpoint there; "
                f"complete iterations: {whole}"
            )
        path = ckpt.iteration_dir(root, it)
        if not os.path.isfile(os.path.join(path, ckpt.RUN_CONFIG)):
            raise InputError(
                f"{flag} {root}: {path} has no {ckpt.RUN_CONFIG}, so the model cannot be "
                "rebuilt; it was not written by megatron-jreg's trainer"
            )
    return chosen


def read_run_configs(path: str) -> Dict[str, object]:
    """The config sections (model, parallel, data, ...) saved with one iteration directory."""
    from megatron_jreg.config.yaml_settings import from_yaml_text
    from megatron_jreg.training.config import SECTIONS

    text = ckpt.read_run_config(path)
    if text is None:
        raise InputError(f"{path}: no {ckpt.RUN_CONFIG}; cannot rebuild the model")
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


def eval_model_config(model_cfg, vocab_rows: int, dtype: str = "float32"):
    """The saved ModelConfig, with the saved padded vocabulary and the evaluation dtype."""
    return dataclasses.replace(
        model_cfg,
        model_preset=None,
        padded_vocab=vocab_rows,  # already padded: keep the saved row count
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        transformer_impl="local",  # the same weights, whichever implementation trained them
    )


def launched_world_size() -> int:
    """The number of processes torchrun started (1 for a plain ``python`` run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(parallel, world_size: int) -> None:
    """The world must be a whole number of TP x PP model replicas."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise InputError(
            f"{world_size} processes do not split into --tensor-model-parallel-size {tp} x "
            f"--pipeline-model-parallel-size {pp}; launch torchrun --nproc_per_node with a "
            f"multiple of {tp * pp}"
        )


def check_model_split(path: str, model_cfg, vocab_rows: int, parallel) -> None:
    """What the saved model must satisfy to be built at this TP/PP; InputError otherwise."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    if vocab_rows % tp:
        fits = [d for d in range(1, 9) if vocab_rows % d == 0]
        raise InputError(
            f"{path}: the saved embedding has {vocab_rows} rows (the vocabulary as padded at "
            f"save time), not divisible by --tensor-model-parallel-size {tp}; evaluate with a "
            f"TP size that divides {vocab_rows} (e.g. {fits})"
        )
    for what, value in (
        ("attention heads", model_cfg.num_attention_heads),
        ("query groups", model_cfg.query_groups),
        ("FFN size", model_cfg.ffn_size),
    ):
        if value % tp:
            raise InputError(
                f"{path}: the model's {value} {what} are not divisible by "
                f"--tensor-model-parallel-size {tp}; choose a TP size that divides {value}"
            )
    if model_cfg.num_layers % pp:
        raise InputError(
            f"{path}: the model's {model_cfg.num_layers} layers are not divisible by "
            f"--pipeline-model-parallel-size {pp}; choose a PP size that divides them"
        )


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def init_world(device: str | torch.device = "cpu") -> torch.device:
    """The default process group (a world of one, or torchrun's); returns this rank's device.

    gloo and the CPU redirections on CPU, NCCL on GPUs. One process may name its GPU
    (``cuda:1``); under torchrun each rank takes the GPU of its LOCAL_RANK.
    """
    import torch.distributed as dist

    from megatron_jreg.distributed.setup import initialize_distributed

    dev = torch.device(device)
    if dev.type == "cpu":
        os.environ["MEGATRON_JREG_DEVICE"] = "cpu"  # use_cpu(): gloo and the CPU redirections
    elif dev.index is not None and launched_world_size() > 1:
        raise InputError(
            f"--device {device}: under torchrun give --device cuda; each rank takes the GPU "
            "of its LOCAL_RANK"
        )
    fresh = not dist.is_initialized()
    initialize_distributed(gpu=dev.index if dev.type == "cuda" else None)
    if fresh:
        atexit.register(_destroy_process_group)
    if dev.type != "cuda":
        return torch.device("cpu")
    if dev.index is not None:
        torch.cuda.set_device(dev)  # also where a process group was started before
        return dev
    return torch.device("cuda", torch.cuda.current_device())


@dataclass(kw_only=True)
class LoadedModel:
    """A checkpoint iteration built as this rank's chunks of the TP/PP model, eval mode."""

    root: str
    iteration: int
    path: str
    configs: Dict[str, object]
    """The saved run config sections (model as trained, parallel as saved, data, ...)."""
    model_config: object
    """The ModelConfig the model was built with (saved padded vocabulary, local layers)."""
    parallel: object
    """The ParallelConfig it was built at (TP1 PP1 on one process)."""
    chunks: List[torch.nn.Module]
    """This rank's megatron-core GPTModel chunks, weights loaded, eval mode."""
    device: torch.device

    @property
    def model(self) -> torch.nn.Module:
        """The whole model: the one chunk of a TP1 PP1 build."""
        if len(self.chunks) != 1:
            raise RuntimeError(f"the model is split into {len(self.chunks)} chunks here")
        return self.chunks[0]

    @property
    def vocab_size(self) -> int:
        """The unpadded vocabulary of the run: every real token id is below it."""
        return int(self.configs["model"].vocab_size or self.model_config.vocab_size)

    @property
    def padded_vocab_size(self) -> int:
        return int(self.model_config.padded_vocab_size())

    @property
    def seed(self) -> int:
        return int(self.configs["training"].seed)


def load_model(
    root: str,
    iteration: Optional[int] = None,
    parallel=None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
) -> LoadedModel:
    """Build the run's model at ``parallel`` (default TP1 PP1) and load ``iteration``.

    ``iteration`` None takes the one ``latest_checkpointed_iteration.txt`` names. Under
    torchrun the world must be a multiple of TP x PP; the rest is data parallel.
    """
    import torch.distributed as dist

    from megatron_jreg.distributed.setup import initialize_model_parallel, seed_everything
    from megatron_jreg.model.builder import build_model
    from megatron_jreg.model.config import ParallelConfig

    parallel = parallel if parallel is not None else ParallelConfig()
    if iteration is None:
        (iteration,) = checkpoint_iterations(root)
    path = ckpt.iteration_dir(root, iteration)
    configs = read_run_configs(path)
    rows = saved_vocab_rows(path, configs["model"])
    model_cfg = eval_model_config(configs["model"], rows, dtype)
    check_model_split(path, model_cfg, rows, parallel)
    torch_device = init_world(device)
    check_layout(parallel, dist.get_world_size())
    initialize_model_parallel(model_cfg, parallel)
    # megatron's layers draw their (overwritten) init from the model-parallel RNG streams
    seed_everything(int(configs["training"].seed))
    chunks = build_model(model_cfg, parallel, tracker=None)
    for chunk in chunks:
        chunk.to(torch_device)
    try:
        ckpt.load_checkpoint(root, iteration, chunks, optimizer=None, step_flag=ITERATION_FLAG)
    except ckpt.CheckpointError as err:
        raise InputError(str(err)) from None
    for chunk in chunks:
        chunk.eval()
    return LoadedModel(
        root=root,
        iteration=iteration,
        path=path,
        configs=configs,
        model_config=model_cfg,
        parallel=parallel,
        chunks=chunks,
        device=torch_device,
    )


def build_run_tokenizer(configs: Dict[str, object], tokenizer_model: Optional[str] = None):
    """The tokenizer the run trained with (``tokenizer_model`` overrides a moved file).

    Megatron-LM's types come from the same flags the trainer read: GPT2BPETokenizer from the
    run's ``--vocab-file``/``--merge-file`` (a ``tokenizer_model`` override is the directory
    now holding vocab.json and merges.txt), NullTokenizer from the saved vocabulary, which
    counts its EOD (the trainer saves ``--vocab-size`` + 1).
    """
    from megatron_jreg.data.tokenizers.build import build_tokenizer

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


_WARNED: set = set()


def _check_pinned(configs, tokenizer, model_file, override: Optional[str]) -> None:
    """The tokenizer built must be the one the run trained with (its saved identity): a
    file retrained in place is refused; one passed with --tokenizer-model is used as
    asked, said once."""
    from megatron_jreg.data.tokenizers.build import describe_tokenizer, tokenizer_identity

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
