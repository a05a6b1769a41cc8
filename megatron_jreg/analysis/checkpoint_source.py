"""Hidden states of our trainer's checkpoints (``eval_jump --load``), at any TP/PP/CP layout.

:func:`checkpoint_entries` turns the ``--load`` flags into one entry per iteration; each is
loaded by :func:`megatron_jreg.checkpoint.model_loader.load_model` (on one process, or over a
torchrun world) and run through megatron's pipeline schedule, with hooks on this rank's decoder
layers handing each layer's ``(h_{l-1}, h_l)`` to the :class:`JumpAccumulator`: the pair the
trainer's :class:`JregTracker` measures, so ``Psi_l`` here equals the trainer's.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import List, Optional

import torch

from megatron_jreg.analysis.batching import MeasureWorld, one_process
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.analysis.layer_capture import LayerCapture
from megatron_jreg.analysis.source_flags import CheckpointSourceFlags
from megatron_jreg.analysis.sources import SourceEntry
from megatron_jreg.checkpoint.formats import Source
from megatron_jreg.checkpoint.model_loader import LoadedModel, check_layout, load_model
from megatron_jreg.checkpoint.run_configs import (
    build_run_tokenizer,
    checkpoint_sources,
    launched_world_size,
)
from megatron_jreg.config.model import ParallelConfig
from megatron_jreg.config.resolve import effective_parallel
from megatron_jreg.errors import InputError
from megatron_jreg.model.builder import causal_attention_mask
from megatron_jreg.ops.context_chunks import local_part
from megatron_jreg.ops.psi_accumulator import local_token_mask, owns_tokens
from megatron_jreg.platform.device import resolve_device


class CheckpointSource:
    """One checkpoint iteration (this rank's chunks of it) feeding a JumpAccumulator."""

    def __init__(
        self,
        loaded: LoadedModel,
        name: str,
        include_final_norm: bool = False,
        tokenizer_model: Optional[str] = None,
    ):
        from megatron.core import parallel_state as ps

        self.loaded = loaded
        self.name = name
        self.include_final_norm = include_final_norm
        self.num_layers = int(loaded.model_config.num_layers)
        self.vocab_size = loaded.vocab_size
        self.pad_id = 0  # never counted; any id below the vocabulary works
        self.device = loaded.device
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        self.sequence_parallel = bool(loaded.parallel.sequence_parallel)
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_size = ps.get_context_parallel_world_size()
        self._tokenizer_model = tokenizer_model
        self._tokenizer = None  # built on first use: --data-path needs none
        layers, final_norm = [], None
        for chunk in loaded.chunks:
            decoder = chunk.decoder
            for layer in decoder.layers:
                layers.append((int(layer.layer_number), layer))
                if layer.layer_number == self.num_layers:
                    final_norm = decoder.final_layernorm
        # h_L is taken before the final norm unless include_final_norm
        self._capture = LayerCapture(name, layers, self.num_layers, final_norm,
                                     include_final_norm, stop_after_last=False)

    def tokenize(self, text: str) -> List[int]:
        # as the trainer's data was tokenized: ``tokenizer.encode``, no BOS/EOS
        if self._tokenizer is None:
            self._tokenizer = build_run_tokenizer(self.loaded.configs, self._tokenizer_model)
        return list(self._tokenizer.encode(text))

    @torch.no_grad()
    def accumulate(self, input_ids: torch.Tensor, mask: torch.Tensor, acc: JumpAccumulator) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        batch, seq = input_ids.shape
        cfg = self.loaded.model_config
        positions = torch.arange(seq).expand(batch, seq)
        if cfg.position_embedding_type == "learned_absolute":
            longest = int(mask.sum(dim=1).max())  # right padding: the last real position + 1
            if longest > cfg.max_positions:
                raise InputError(f"--seq-length {longest}: the model has learned positions for "
                                 f"{cfg.max_positions} tokens only; pass --seq-length "
                                 f"{cfg.max_positions} or less")
            # padding rounded past the last learned position is never attended to nor counted
            positions = positions.clamp(max=cfg.max_positions - 1)
        # this CP rank's two chunks of the sequence (everything, at CP1); the schedule takes
        # the whole length and megatron-core divides it by CP itself, as in training
        tokens, positions = (local_part(t, 1, self.cp_size, self.cp_rank).to(self.device)
                             for t in (input_ids, positions))
        # right padding + the whole sequence's causal mask: real tokens never attend to padding
        attention_mask = causal_attention_mask(seq, device=self.device)

        def forward_step(data_iterator, model):
            output = model(tokens, positions, attention_mask)  # logits on the last stage
            return output, lambda _: (torch.zeros((), device=self.device), {})

        # the [s_local, b] mask of this rank's hidden states (CP chunks, then the SP chunk),
        # with the tokens it adds: a CP rank's chunks are its own. Each token is counted once,
        # by the trainer's rule, so one all-reduce gives the sums of one process.
        local = local_token_mask(mask, self.sequence_parallel, self.tp_rank, self.tp_size,
                                 self.cp_size, self.cp_rank)
        if not owns_tokens(self.sequence_parallel, self.tp_rank):
            local = torch.zeros_like(local)  # TP rank 0 adds the replicated tokens
        chunks = self.loaded.chunks
        self._capture.run(acc, local.to(self.device), lambda: get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([None]) for _ in chunks] if len(chunks) > 1 else iter([None]),
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=batch,
            forward_only=True,
        ))


def load_checkpoint_source(
    source: Source,
    parallel: ParallelConfig,
    name: str,
    include_final_norm: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    tokenizer_model: Optional[str] = None,
) -> CheckpointSource:
    """Load ``source`` (an iteration found and described) at the layout ``parallel`` (this
    rank's chunks under torchrun), ready to measure."""
    loaded = load_model(source, parallel=parallel, device=device, dtype=dtype)
    return CheckpointSource(loaded, name, include_final_norm, tokenizer_model)


def checkpoint_world(sequence_parallel: bool) -> MeasureWorld:
    """The world the loaded model runs in: one process, or this rank's data-parallel share
    (the CP ranks of a DP rank share its documents, each holding its chunks of them)."""
    from megatron.core import parallel_state as ps

    if launched_world_size() == 1:
        return one_process()
    tp = ps.get_tensor_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    return MeasureWorld(
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        # the sequence splits into 2 x CP equal chunks, each evenly over TP under SP
        width_multiple=(2 * cp if cp > 1 else 1) * (tp if sequence_parallel else 1),
        layout={
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
            "context_parallel_size": cp,
            "data_parallel_size": ps.get_data_parallel_world_size(),
            "sequence_parallel": sequence_parallel,
        },
    )


def _run_name(root: str) -> str:
    return os.path.basename(os.path.normpath(os.path.abspath(root)))


def parallel_layout(flags: CheckpointSourceFlags) -> ParallelConfig:
    """The ParallelConfig the flags ask for (TP1 PP1 for a plain one-process run)."""
    tp = flags.tensor_model_parallel_size
    pp = flags.pipeline_model_parallel_size
    cp = flags.context_parallel_size
    sp = bool(flags.sequence_parallel)
    world = launched_world_size()
    try:
        parallel = effective_parallel(ParallelConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
            context_parallel_size=cp,
        ))
    except ValueError as err:
        raise InputError(str(err)) from None
    if sp and not parallel.sequence_parallel:
        print("--sequence-parallel: turned off at --tensor-model-parallel-size 1, "
              "as in Megatron-LM", file=sys.stderr)
    if world < tp * pp * cp:
        sizes = (f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}"
                 + (f" x --context-parallel-size {cp}" if cp > 1 else ""))
        raise InputError(
            f"{sizes} needs {tp * pp * cp} processes, but {world} were launched; run under "
            f"`torchrun --nproc_per_node {tp * pp * cp}` (or a multiple of it)"
        )
    check_layout(parallel, world)
    return parallel


def checkpoint_entries(
    flags: CheckpointSourceFlags,
    *,
    include_final_norm: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> List[SourceEntry]:
    """One entry per iteration to measure of each run in ``flags.load`` (none when it is
    empty), at the layout the flags ask for, run on ``device`` in ``dtype``. The layout,
    the device and the iterations are checked now, before any checkpoint loads."""
    roots = list(flags.load or [])
    if not roots:
        return []
    parallel = parallel_layout(flags)
    trajectory = bool(flags.all_iterations or flags.iterations)
    if trajectory and len(roots) > 1:
        raise InputError(
            f"--all-iterations/--iterations follow one run, but --load got {len(roots)} "
            "directories; measure one run per trajectory"
        )
    tokenizer_model = flags.tokenizer_model
    if tokenizer_model is not None and not os.path.exists(tokenizer_model):
        raise InputError(f"--tokenizer-model {tokenizer_model}: no such file or directory")
    resolve_device(device)  # a bad --device fails before any checkpoint is read
    entries = []
    for root in roots:
        sources = checkpoint_sources(
            root,
            iteration=flags.iteration,
            iterations=flags.iterations,
            all_iterations=bool(flags.all_iterations),
        )
        for source in sources:
            it = source.iteration
            label = f"{_run_name(root)}@{it}"

            entries.append(
                SourceEntry(
                    label=label,
                    open=functools.partial(load_checkpoint_source, source, parallel, label,
                                           include_final_norm, device, dtype, tokenizer_model),
                    # a trajectory sorts and tabulates by iteration; several runs do not
                    iteration=it if len(roots) == 1 else None,
                    describe=os.path.abspath(root),
                    extra={"iteration": it},
                    world=lambda: checkpoint_world(parallel.sequence_parallel),
                )
            )
    return entries
