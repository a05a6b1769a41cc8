"""Logits of a checkpoint at a TP/PP layout, for tests/analysis/test_convert_from_hf.py.

    torchrun --nproc_per_node N import_logits_worker.py CKPT TP PP IDS.pt OUT.pt

Loads CKPT with ``model_loader.load_model`` at TP x PP (dist-checkpointing reshards the
saved tensors), runs IDS ([b, s] token ids) through megatron's pipeline schedule, gathers
the vocabulary-parallel logits of the last stage over the TP ranks and saves them from
the last stage's first TP rank.
"""

import sys

import torch


def main(root, tp, pp, ids_file, out_file):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_jreg.checkpoint.model_loader import load_model
    from megatron_jreg.config.model import ParallelConfig
    from megatron_jreg.model.builder import causal_attention_mask

    loaded = load_model(root, parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                                      pipeline_model_parallel_size=pp))
    ids = torch.load(ids_file)
    batch, seq = ids.shape
    positions = torch.arange(seq).expand(batch, seq)
    mask = causal_attention_mask(seq)
    outputs = []

    def forward_step(data_iterator, model):
        logits = model(ids, positions, mask)
        if ps.is_pipeline_last_stage():
            outputs.append(logits)
        return logits, lambda _: (torch.zeros(()), {})

    with torch.no_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=loaded.model,
            num_microbatches=1, seq_length=seq, micro_batch_size=batch, forward_only=True)
    if ps.is_pipeline_last_stage():
        (local,) = outputs
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        if ps.get_tensor_model_parallel_rank() == 0:
            torch.save(torch.cat(parts, dim=-1), out_file)


if __name__ == "__main__":
    root, tp, pp, ids_file, out_file = sys.argv[1:]
    main(root, int(tp), int(pp), ids_file, out_file)
