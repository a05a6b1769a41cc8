"""Open one iteration of a megatron-jreg checkpoint as a model, at any TP/PP layout.

Shared by ``eval_jump --load`` (one process, or under torchrun) and
``tools/convert_to_hf.py``. The run's resolved config rebuilds the model at the requested
TP/PP, with the embedding's rows as saved; dist-checkpointing reshards the weights. What a
user can get wrong raises :class:`InputError` before any weights are read where it can.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron_jreg.checkpoint.formats import Source
from megatron_jreg.checkpoint.loading import load_checkpoint
from megatron_jreg.checkpoint.run_configs import (
    checkpoint_sources,
    launched_world_size,
    saved_vocab_rows,
)
from megatron_jreg.config.model import ParallelConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
    teardown,
)
from megatron_jreg.errors import InputError
from megatron_jreg.model.builder import build_model


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


def check_layout(parallel, world_size: int) -> None:
    """The world must be a whole number of TP x PP (x CP) model replicas."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    cp = parallel.context_parallel_size
    if world_size % (tp * pp * cp):
        sizes = (f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
                 + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
        raise InputError(
            f"{world_size} processes do not split into {sizes}; launch torchrun "
            f"--nproc_per_node with a multiple of {tp * pp * cp}"
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
    sizes = [("attention heads", model_cfg.num_attention_heads),
             ("query groups", model_cfg.query_groups), ("FFN size", model_cfg.ffn_size)]
    if getattr(model_cfg, "num_experts", None):  # each expert's MLP: over the same TP ranks
        sizes.append(("expert FFN size", model_cfg.moe_ffn_size))
    for what, value in sizes:
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


def init_world(device: str | torch.device = "cpu") -> torch.device:
    """The default process group (a world of one, or torchrun's); returns this rank's device.

    gloo and the CPU redirections on CPU, NCCL on GPUs. One process may name its GPU
    (``cuda:1``); under torchrun each rank takes the GPU of its LOCAL_RANK.
    """
    import torch.distributed as dist

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
        atexit.register(teardown)
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
    source: Source | str,
    iteration: Optional[int] = None,
    parallel=None,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
) -> LoadedModel:
    """Build the run's model at ``parallel`` (default TP1 PP1) and load ``source`` (a
    found and described iteration, or a save directory and ``iteration``, None for the
    one the tracker names). Under torchrun the world must be a multiple of TP x PP x CP; the
    rest is data parallel."""
    import torch.distributed as dist

    parallel = parallel if parallel is not None else ParallelConfig()
    if isinstance(source, str):
        (source,) = checkpoint_sources(source, iteration=iteration)
    path, configs = source.path, dict(source.format.configs)
    rows = saved_vocab_rows(source)
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
    load_checkpoint(source, chunks, optimizer=None)
    for chunk in chunks:
        chunk.eval()
    return LoadedModel(
        root=source.ref.root,
        iteration=source.iteration,
        path=path,
        configs=configs,
        model_config=model_cfg,
        parallel=parallel,
        chunks=chunks,
        device=torch_device,
    )
