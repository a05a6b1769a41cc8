"""The flags of eval_jump's two kinds of model, light to import (``--help`` and a bad flag
answer before the model code loads): ``HFSourceFlags`` for ``--hf-model``
(:func:`hf_source.hf_entries`) and ``CheckpointSourceFlags`` for ``--load``
(:func:`checkpoint_source.checkpoint_entries`), whose layout flags are ParallelConfig's own."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from megatron_jreg import hf_models
from megatron_jreg.config.model import ParallelConfig
from megatron_jreg.config.schema import flag_of


@dataclasses.dataclass(kw_only=True)
class HFSourceFlags:
    """The flags that select Hugging Face models to measure."""

    hf_model: Optional[List[str]] = dataclasses.field(default=None, metadata={
        "metavar": "MODEL",
        "help": "Hugging Face causal LMs (Llama, Qwen, Gemma, Mistral, ...): a directory "
        "written by save_pretrained, a hub id already in the local Hugging Face cache (read "
        "offline, never downloaded), or a .gguf file (dequantized by transformers); several "
        "go on one plot. Needs the hf extra: `pip install --no-build-isolation -e "
        "'.[hf]'` from the repository root."})
    device_map: Optional[str] = dataclasses.field(default=None, metadata={
        "choices": list(hf_models.DEVICE_MAPS),
        "help": "--hf-model only, for a model larger than one GPU: accelerate spreads its "
        "layers over the visible GPUs (auto: evenly, then the CPU when they are full); "
        "without a GPU all of it runs on the CPU. Replaces --device; combine with --dtype "
        "bfloat16 (psi is still computed in fp32). Needs accelerate."})


# The layout flags are ParallelConfig's own (one definition of each); help for eval_jump.
LAYOUT_FIELDS = {
    "tensor_model_parallel_size": "--load under torchrun: tensor-parallel ranks; "
    "the world's remaining factor after TP x PP x CP is data parallel",
    "pipeline_model_parallel_size": "--load under torchrun: pipeline stages",
    "sequence_parallel": "--load under torchrun: split the sequence over the TP ranks "
    "(needs TP > 1)",
    "context_parallel_size": "--load under torchrun: context-parallel ranks, each holding 2 "
    "of 2 x CP chunks of every sequence (batches are padded to a multiple of 2 x CP); the "
    "world's remaining factor after TP x PP x CP is data parallel",
}


def layout_flags() -> Dict[str, str]:
    """{ParallelConfig field: its flag} for the layout flags of ``--load``."""
    flags = {f.name: flag_of(f) for f in dataclasses.fields(ParallelConfig)}
    return {name: flags[name] for name in LAYOUT_FIELDS}


def layout_flags_given(args) -> List[str]:
    """The layout flags set away from their defaults (one process, TP1 PP1)."""
    defaults = ParallelConfig()
    return [flag for name, flag in layout_flags().items()
            if getattr(args, name, getattr(defaults, name)) != getattr(defaults, name)]


def _layout_field(name: str, default):
    return dataclasses.field(default=default, metadata={
        "flag": layout_flags()[name], "help": LAYOUT_FIELDS[name],
        **({} if isinstance(default, bool) else {"metavar": "N"})})


@dataclasses.dataclass(kw_only=True)
class CheckpointSourceFlags:
    """The flags that select checkpoints of our trainer to measure (``--load``)."""

    load: Optional[List[str]] = dataclasses.field(default=None, metadata={
        "metavar": "CKPT",
        "help": "torch_dist checkpoint directories of our trainer or of Megatron-LM (its "
        "--save); any TP/PP layout, Transformer Engine or local spec, is read "
        "on one process, or under torchrun at --tensor/--pipeline-model-parallel-size and "
        "--context-parallel-size. "
        "The latest iteration unless --iteration/--iterations/--all-iterations"})
    iteration: Optional[int] = dataclasses.field(default=None, metadata={
        "exclusive": "iteration", "metavar": "N", "help": "--load: this iteration"})
    iterations: Optional[List[int]] = dataclasses.field(default=None, metadata={
        "exclusive": "iteration", "metavar": "N",
        "help": "--load: these iterations of one run (a trajectory)"})
    all_iterations: bool = dataclasses.field(default=False, metadata={
        "exclusive": "iteration",
        "help": "--load: every complete iteration of one run (a trajectory table and plot)"})
    tokenizer_model: Optional[str] = dataclasses.field(default=None, metadata={
        "metavar": "PATH",
        "help": "--load: the run's tokenizer file, when it moved since training"})
    tensor_model_parallel_size: int = _layout_field("tensor_model_parallel_size", 1)
    pipeline_model_parallel_size: int = _layout_field("pipeline_model_parallel_size", 1)
    sequence_parallel: bool = _layout_field("sequence_parallel", False)
    context_parallel_size: int = _layout_field("context_parallel_size", 1)
