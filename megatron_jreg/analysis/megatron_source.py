"""Hidden states of our trainer's checkpoints (``eval_jump --load``), on one process.

(Under torchrun, or with ``--tensor-model-parallel-size``/``--pipeline-model-parallel-size``,
the model is spread over the ranks instead: see :mod:`distributed_measure`.)

The checkpoint is rebuilt as a TP1 PP1 megatron-core GPTModel (see
:mod:`checkpoint_loader`), whatever layout saved it. Forward hooks on the decoder layers
hand each layer's input ``h_{l-1}`` and output ``h_l`` ([s, b, h]) to the accumulator:
the same pair the training-time :class:`JregTracker` measures inside each layer, so
``Psi_l`` here equals the trainer's on the same tokens. ``h_L`` is taken before the final
norm unless ``include_final_norm``.

Documents are tokenized as the trainer's data was (``tokenizer.encode``: no BOS/EOS).
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

import torch

from megatron_jreg.analysis.checkpoint_loader import (
    LoadedCheckpoint,
    build_run_tokenizer,
    checkpoint_iterations,
    load_checkpoint_model,
)
from megatron_jreg.analysis.errors import InputError
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.analysis.layer_capture import LayerCapture
from megatron_jreg.analysis.sources import SourceEntry, SourceKind


class MegatronCheckpointSource:
    """One loaded checkpoint iteration whose decoder layers feed a JumpAccumulator."""

    def __init__(
        self,
        loaded: LoadedCheckpoint,
        name: str,
        include_final_norm: bool = False,
        tokenizer_model: Optional[str] = None,
    ):
        self.loaded = loaded
        self.model = loaded.model
        self.name = name
        self.include_final_norm = include_final_norm
        self.layers = self.model.decoder.layers
        self.final_norm = self.model.decoder.final_layernorm
        self.num_layers = len(self.layers)
        self.vocab_size = loaded.vocab_size
        self.pad_id = 0  # never counted; any id below the vocabulary works
        self.device = next(self.model.parameters()).device
        self._tokenizer_model = tokenizer_model
        self._tokenizer = None  # built on first use: --data-path needs none
        self._capture = LayerCapture(name, self.layers, [l.layer_number for l in self.layers],
                                     self.final_norm, include_final_norm)

    def tokenize(self, text: str) -> List[int]:
        if self._tokenizer is None:
            self._tokenizer = build_run_tokenizer(self.loaded.configs, self._tokenizer_model)
        return list(self._tokenizer.encode(text))

    @torch.no_grad()
    def accumulate(self, input_ids: torch.Tensor, mask: torch.Tensor, acc: JumpAccumulator) -> None:
        from megatron_jreg.model.builder import causal_attention_mask

        batch, seq = input_ids.shape
        tokens = input_ids.to(self.device)
        positions = torch.arange(seq, device=self.device).expand(batch, seq)
        # right padding + a causal mask: real tokens never attend to padding
        attention_mask = causal_attention_mask(seq, device=self.device)
        self._capture.run(acc, mask.t().to(self.device),  # [s, b], like the hidden states
                          lambda: self.model(tokens, positions, attention_mask))


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--load",
        nargs="+",
        metavar="CKPT",
        default=None,
        help="checkpoint directories of our trainer (its --save); any TP/PP layout is read "
        "on one process, or under torchrun at --tensor/--pipeline-model-parallel-size. "
        "The latest iteration unless --iteration/--iterations/--all-iterations",
    )
    which = group.add_mutually_exclusive_group()
    which.add_argument(
        "--iteration", type=int, default=None, metavar="N", help="--load: this iteration"
    )
    which.add_argument(
        "--iterations",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="--load: these iterations of one run (a trajectory)",
    )
    which.add_argument(
        "--all-iterations",
        action="store_true",
        help="--load: every complete iteration of one run (a trajectory table and plot)",
    )
    group.add_argument(
        "--tokenizer-model",
        default=None,
        metavar="PATH",
        help="--load: the run's tokenizer file, when it moved since training",
    )
    group.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="--load under torchrun: tensor-parallel ranks (default: 1); the world's remaining "
        "factor after TP x PP is data parallel",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="--load under torchrun: pipeline stages (default: 1)",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="--load under torchrun: split the sequence over the TP ranks (needs TP > 1)",
    )


def _run_name(root: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(root)))


def parallel_layout(args: argparse.Namespace):
    """The ParallelConfig the flags ask for, or None for the one-process TP1 PP1 path."""
    from megatron_jreg.analysis.distributed_measure import check_layout, launched_world_size
    from megatron_jreg.model.config import ParallelConfig

    tp = getattr(args, "tensor_model_parallel_size", 1)
    pp = getattr(args, "pipeline_model_parallel_size", 1)
    sp = bool(getattr(args, "sequence_parallel", False))
    world = launched_world_size()
    if world == 1 and tp == 1 and pp == 1 and not sp:
        return None
    try:
        parallel = ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp
        )
    except ValueError as err:
        raise InputError(str(err)) from None
    if world < tp * pp:
        raise InputError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
            f"{tp * pp} processes, but {world} were launched; run under "
            f"`torchrun --nproc_per_node {tp * pp}` (or a multiple of it)"
        )
    check_layout(parallel, world)
    return parallel


def _build(args: argparse.Namespace) -> List[SourceEntry]:
    roots = list(args.load)
    parallel = parallel_layout(args)
    trajectory = bool(getattr(args, "all_iterations", False) or getattr(args, "iterations", None))
    if trajectory and len(roots) > 1:
        raise InputError(
            f"--all-iterations/--iterations follow one run, but --load got {len(roots)} "
            "directories; measure one run per trajectory"
        )
    include_final_norm = bool(getattr(args, "include_final_norm", False))
    device = getattr(args, "device", "cpu")
    dtype = getattr(args, "dtype", "float32")
    tokenizer_model = getattr(args, "tokenizer_model", None)
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):
        raise InputError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
    from megatron_jreg.analysis.hf_source import resolve_device

    resolve_device(device)  # a bad --device fails before any checkpoint is read
    entries = []
    for root in roots:
        iterations = checkpoint_iterations(
            root,
            iteration=getattr(args, "iteration", None),
            iterations=getattr(args, "iterations", None),
            all_iterations=bool(getattr(args, "all_iterations", False)),
        )
        for it in iterations:
            label = f"{_run_name(root)}@{it}"

            def open_source(root: str = root, it: int = it, label: str = label):
                if parallel is not None:
                    from megatron_jreg.analysis import distributed_measure as dm

                    sharded = dm.load_sharded_checkpoint(root, it, parallel, device, dtype)
                    return dm.ShardedCheckpointSource(
                        sharded, label, include_final_norm, tokenizer_model
                    )
                loaded = load_checkpoint_model(root, it, device=device, dtype=dtype)
                return MegatronCheckpointSource(loaded, label, include_final_norm, tokenizer_model)

            entries.append(
                SourceEntry(
                    label=label,
                    open=open_source,
                    # a trajectory sorts and tabulates by iteration; several runs do not
                    iteration=it if len(roots) == 1 else None,
                    describe=os.path.abspath(root),
                    extra={"iteration": it},
                )
            )
    return entries


CHECKPOINT_SOURCE_KIND = SourceKind(
    name="checkpoint",
    flag="--load",
    add_arguments=_add_arguments,
    selected=lambda args: bool(getattr(args, "load", None)),
    build=_build,
)
