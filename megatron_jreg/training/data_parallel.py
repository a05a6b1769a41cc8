"""megatron-core's DistributedDataParallel around the model chunks, with Megatron-LM's
overlap flags (--overlap-grad-reduce, --overlap-param-gather) wired as Megatron-LM wires them.
"""

from __future__ import annotations

from typing import List

from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def wrap(chunks, config, experiment) -> List[DistributedDataParallel]:
    """DDP per model chunk, and the schedule's sync hooks on ``config``.

    --overlap-grad-reduce starts each bucket's reduction as soon as its gradients are ready
    in the last micro-batch (the schedules hold it back for the others through
    ``no_sync_func``). --overlap-param-gather leaves the distributed optimizer's all-gather
    of updated parameters to the next forward, where each module waits for its own bucket
    (megatron-core's forward pre-hooks); a bucket's gather is started when first needed, so
    no ``param_sync_func`` is set (Megatron-LM sets one only to align interleaved stages).
    """
    model, parallel, optim = experiment.model, experiment.parallel, experiment.optim
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=model.bf16 or model.fp16,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        overlap_param_gather=parallel.overlap_param_gather,
        use_distributed_optimizer=optim.use_distributed_optimizer,
    )
    # Bucketing only for the first chunk: the others' communication overlaps compute anyway
    # (Megatron-LM's choice).
    wrapped = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
               for i, chunk in enumerate(chunks)]
    no_sync = [m.no_sync for m in wrapped]
    config.no_sync_func = no_sync if len(wrapped) > 1 else no_sync[0]
    if parallel.overlap_grad_reduce:
        grad_sync = [m.start_grad_sync for m in wrapped]
        config.grad_sync_func = grad_sync if len(wrapped) > 1 else grad_sync[0]
    return wrapped


def sync_params(wrapped) -> None:
    """Finish the parameters' all-gather now (under --overlap-param-gather the updated
    parameters of other ranks' shards arrive only in the next forward): before a save or
    a validation run reads them. A no-op without the overlap."""
    for chunk in wrapped:
        if chunk.ddp_config.overlap_param_gather and chunk.ddp_config.use_distributed_optimizer:
            chunk.start_param_sync(force_sync=True)
