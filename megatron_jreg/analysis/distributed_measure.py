"""``eval_jump --load`` under torchrun: the checkpoint at any TP/PP, data parallel over the rest.

    torchrun --nproc_per_node 4 tools/eval_jump.py --load CKPT --tensor-model-parallel-size 2 ...

The run's model is rebuilt at the requested TP/PP (dist-checkpointing reshards the
weights from whatever layout saved them); the world's remaining factor is data parallel,
each DP rank taking every ``dp``-th document. Forward hooks on this rank's decoder layers
add the masked sum of ``psi_l`` and the token count of each layer to a
:class:`JumpAccumulator`; one all-reduce over the world then gives exactly the sums a
single process would have, so ``Psi_l = sum / count`` is the single-process number:

- each layer lives on one pipeline stage (the others add zeros);
- without sequence parallelism the TP ranks hold identical states: only TP rank 0 counts;
- with it each TP rank holds ``s/tp`` of the sequence (``[s/tp, b, h]``), so its share of
  the ``[s, b]`` token mask is the TP rank's chunk along the sequence;
- DP ranks hold disjoint documents.

The forward runs through megatron's pipeline schedule (it does the stage-to-stage p2p),
every batch one micro-batch of the same shape ``[batch_size, width]`` on every rank, so
p2p shapes agree; DP ranks short of documents run fully masked batches (zero tokens).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional

import torch

from megatron_jreg.analysis.checkpoint_loader import (
    ITERATION_FLAG,
    build_run_tokenizer,
    eval_model_config,
    read_run_configs,
    saved_vocab_rows,
)
from megatron_jreg.analysis.errors import InputError
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator, JumpReport
from megatron_jreg.analysis.layer_capture import _layer_output
from megatron_jreg.analysis.measure import pad_batch
from megatron_jreg.ops.token_mask import local_token_mask


def launched_world_size() -> int:
    """The number of processes torchrun started (1 for a plain ``python`` run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_output_rank() -> bool:
    """Only global rank 0 prints tables and writes files."""
    return int(os.environ.get("RANK", "0")) == 0


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


def init_world(device: str) -> torch.device:
    """The default process group for a torchrun launch; returns this rank's device."""
    if torch.device(device).type == "cpu":
        os.environ["MEGATRON_JREG_DEVICE"] = "cpu"  # gloo and the CPU redirections
    elif torch.device(device).index is not None and launched_world_size() > 1:
        raise InputError(
            f"--device {device}: under torchrun give --device cuda; each rank takes the GPU "
            "of its LOCAL_RANK"
        )
    import torch.distributed as dist

    from megatron_jreg.distributed.setup import initialize_distributed

    if not dist.is_initialized():
        initialize_distributed()
        atexit.register(_destroy_process_group)
    if torch.device(device).type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(kw_only=True)
class ShardedCheckpoint:
    """A checkpoint iteration built as this rank's chunks of the TP/PP model, eval mode."""

    root: str
    iteration: int
    path: str
    configs: Dict[str, object]
    model_config: object
    parallel: object
    chunks: List[torch.nn.Module]
    device: torch.device

    @property
    def vocab_size(self) -> int:
        """The unpadded vocabulary of the run: every real token id is below it."""
        return int(self.configs["model"].vocab_size or self.model_config.vocab_size)


def load_sharded_checkpoint(
    root: str, iteration: int, parallel, device: str = "cpu", dtype: str = "float32"
) -> ShardedCheckpoint:
    """Build the run's model at ``parallel``'s TP/PP over the torchrun world and load it."""
    from megatron_jreg.distributed.setup import initialize_model_parallel, seed_everything
    from megatron_jreg.model.builder import build_model
    from megatron_jreg.checkpoint import dist_checkpoint as ckpt

    path = ckpt.iteration_dir(root, iteration)
    configs = read_run_configs(path)
    rows = saved_vocab_rows(path, configs["model"])
    model_cfg = eval_model_config(configs["model"], rows, dtype)
    if model_cfg.transformer_impl != "local":
        model_cfg = dataclasses.replace(model_cfg, transformer_impl="local")  # same weights
    check_model_split(path, model_cfg, rows, parallel)
    torch_device = init_world(device)
    import torch.distributed as dist

    check_layout(parallel, dist.get_world_size())
    initialize_model_parallel(model_cfg, parallel)
    seed_everything(int(configs["training"].seed))  # the (overwritten) init's RNG streams
    chunks = build_model(model_cfg, parallel, tracker=None)
    for chunk in chunks:
        chunk.to(torch_device)
    try:
        ckpt.load_checkpoint(root, iteration, chunks, optimizer=None, step_flag=ITERATION_FLAG)
    except ckpt.CheckpointError as err:
        raise InputError(str(err)) from None
    for chunk in chunks:
        chunk.eval()
    return ShardedCheckpoint(
        root=root,
        iteration=iteration,
        path=path,
        configs=configs,
        model_config=model_cfg,
        parallel=parallel,
        chunks=chunks,
        device=torch_device,
    )


class ShardedLayerCapture:
    """Hooks on this rank's decoder layers adding their tokens' psi to one accumulator.

    Unlike :class:`LayerCapture` the forward is never stopped (the pipeline schedule must
    finish its p2p) and only the local layers are hooked; ``layer.layer_number`` is the
    global 1-based number. Set the micro-batch's ``[b, s]`` mask before each forward.
    """

    def __init__(self, chunks: List[torch.nn.Module], num_layers: int, include_final_norm: bool,
                 tp_rank: int, tp_size: int, sequence_parallel: bool):
        self.acc = JumpAccumulator(num_layers)
        self.num_layers = num_layers
        self.include_final_norm = include_final_norm
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sequence_parallel = sequence_parallel
        self._mask: Optional[torch.Tensor] = None
        for chunk in chunks:
            decoder = getattr(chunk, "module", chunk).decoder
            for layer in decoder.layers:
                layer.register_forward_hook(
                    self._make_hook(int(layer.layer_number), decoder.final_layernorm),
                    with_kwargs=True,
                )

    def set_mask(self, mask: torch.Tensor) -> None:
        """``mask``: [b, s] bool, True on real tokens; stored as this rank's [s(/tp), b]."""
        local = local_token_mask(mask, self.sequence_parallel, self.tp_rank, self.tp_size)
        if not self.sequence_parallel and self.tp_rank != 0:
            local = torch.zeros_like(local)  # the same states as TP rank 0: count them once
        self._mask = local

    def _make_hook(self, layer_number: int, final_norm: Optional[torch.nn.Module]):
        def hook(module, args, kwargs, output):
            if self._mask is None:
                return None
            h_prev = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            h_next = _layer_output(output)
            if layer_number == self.num_layers and self.include_final_norm:
                h_next = final_norm(h_next)
            mask = self._mask.to(h_prev.device)
            if mask.shape != h_prev.shape[:-1]:
                raise RuntimeError(
                    f"layer {layer_number}: hidden states {tuple(h_prev.shape)} do not match "
                    f"the token mask {tuple(mask.shape)}"
                )
            self.acc.add(layer_number, h_prev, h_next, mask)
            return None

        return hook

    def reduced(self, device: torch.device) -> JumpAccumulator:
        """The sums over every rank of the world (TP, PP and DP), as one accumulator."""
        import torch.distributed as dist

        stats = torch.tensor([self.acc.psi_sums, self.acc.counts], dtype=torch.float64,
                             device=device)  # [2, L]
        dist.all_reduce(stats)
        total = JumpAccumulator(self.num_layers)
        for layer in range(1, self.num_layers + 1):
            total.add_sums(layer, float(stats[0, layer - 1]), int(round(float(stats[1, layer - 1]))))
        return total


def _forward_step(capture: ShardedLayerCapture, bar, data_iterator, model):
    from megatron_jreg.model.builder import causal_attention_mask

    batch = next(data_iterator)
    tokens = batch["tokens"]  # [b, s]
    capture.set_mask(batch["mask"])
    attention_mask = causal_attention_mask(tokens.shape[1], device=tokens.device)
    output = model(tokens, batch["position_ids"], attention_mask)  # logits on the last stage
    bar.update(1)
    return output, lambda _: (torch.zeros((), device=tokens.device), {})


class ShardedCheckpointSource:
    """One checkpoint iteration spread over the torchrun world; measured with :meth:`measure`."""

    def __init__(self, loaded: ShardedCheckpoint, name: str, include_final_norm: bool = False,
                 tokenizer_model: Optional[str] = None):
        from megatron.core import parallel_state as ps

        self.loaded = loaded
        self.name = name
        self.include_final_norm = include_final_norm
        self.num_layers = int(loaded.model_config.num_layers)
        self.vocab_size = loaded.vocab_size
        self.pad_id = 0  # never counted; any id below the vocabulary works
        self._tokenizer_model = tokenizer_model
        self._tokenizer = None
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.sequence_parallel = bool(loaded.parallel.sequence_parallel)
        self._capture = ShardedLayerCapture(
            loaded.chunks, self.num_layers, include_final_norm,
            ps.get_tensor_model_parallel_rank(), self.tp, self.sequence_parallel,
        )

    def tokenize(self, text: str) -> List[int]:
        if self._tokenizer is None:
            self._tokenizer = build_run_tokenizer(self.loaded.configs, self._tokenizer_model)
        return list(self._tokenizer.encode(text))

    def layout(self) -> Dict[str, Any]:
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "data_parallel_size": self.dp,
            "sequence_parallel": self.sequence_parallel,
        }

    def _batches(self, sequences: List[List[int]], batch_size: int) -> List[Dict[str, torch.Tensor]]:
        """This DP rank's batches, all [batch_size, width]; as many on every DP rank."""
        width = max(len(seq) for seq in sequences)
        if self.sequence_parallel:
            width = -(-width // self.tp) * self.tp  # the sequence splits evenly over TP
        per_rank = -(-len(sequences) // self.dp)  # DP rank 0 holds the most documents
        num_batches = -(-per_rank // batch_size)
        mine = sequences[self.dp_rank :: self.dp]
        device = self.loaded.device
        out = []
        for i in range(num_batches):
            tokens, mask = pad_batch(mine[i * batch_size : (i + 1) * batch_size], self.pad_id,
                                     width=width, rows=batch_size)
            out.append({
                "tokens": tokens.to(device),
                "position_ids": torch.arange(width, device=device).expand(batch_size, width),
                "mask": mask.to(device),
            })
        return out

    @torch.no_grad()
    def measure(
        self,
        sequences: Iterable[List[int]],
        *,
        batch_size: int = 8,
        label: Optional[str] = None,
        max_tokens: Optional[int] = None,
        progress: bool = False,
        extra: Optional[Dict[str, Any]] = None,
    ) -> JumpReport:
        """Psi_1..Psi_L over all real tokens of ``sequences``; the same report on every rank.

        Every rank reads every sequence (so the ``--max-tokens`` cut and any input error are
        the same everywhere) and runs its DP rank's share.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if batch_size < 1:
            raise InputError(f"--batch-size must be >= 1, got {batch_size}")
        label = label or self.name
        sequences = list(sequences)
        if not sequences:
            raise InputError(
                "no tokens to evaluate: the input is empty after skipping blank documents; "
                "check --text-file/--jsonl/--data-path"
            )
        batches = self._batches(sequences, batch_size)
        chunks = self.loaded.chunks
        self._capture.acc = JumpAccumulator(self.num_layers)
        from tqdm import tqdm

        with tqdm(total=len(batches), unit="batch", desc=label, disable=not progress,
                  leave=False) as bar:
            iterators = [iter(batches) for _ in chunks]
            get_forward_backward_func()(
                forward_step_func=lambda it, model: _forward_step(self._capture, bar, it, model),
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=len(batches),
                seq_length=batches[0]["tokens"].shape[1],
                micro_batch_size=batch_size,
                forward_only=True,
            )
        self._capture._mask = None
        total = self._capture.reduced(self.loaded.device)
        expected = sum(len(seq) for seq in sequences)
        if total.counts != [expected] * self.num_layers:
            raise RuntimeError(
                f"{label}: the layers counted {total.counts} tokens, expected {expected} each; "
                "a decoder layer was skipped or measured twice"
            )
        info: Dict[str, Any] = {"documents": len(sequences)}
        info.update(extra or {})
        info["parallel"] = self.layout()
        return total.report(label, include_final_norm=self.include_final_norm, extra=info)
