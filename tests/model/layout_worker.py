"""One rank of a parallel-layout check: build the tiny model under a split, load the
reference weights, run one step, save loss, JREG metrics and selected gradients.

Run as `python layout_worker.py SPEC.json` (one rank) or under
`torchrun --standalone --nproc_per_node 2`. Used by test_parallel_layouts.py.
"""

import json
import os
import sys

import torch

from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH = 250, 32, 8, 2
# global key -> (layer number or None, parameter name inside the layer or the model)
TRACKED = {
    "embedding.word_embeddings.weight": (None, "embedding.word_embeddings.weight"),
    "layers.1.self_attention.linear_proj.weight": (1, "self_attention.linear_proj.weight"),
    "layers.1.input_layernorm.weight": (1, "input_layernorm.weight"),
    "layers.4.mlp.linear_fc2.weight": (4, "mlp.linear_fc2.weight"),
    "layers.4.pre_mlp_layernorm.weight": (4, "pre_mlp_layernorm.weight"),
    "decoder.final_layernorm.weight": (None, "decoder.final_layernorm.weight"),
    "output_layer.weight": (None, "output_layer.weight"),
    # the other families' own parameters (absent from a Llama model: not tracked there)
    "embedding.position_embeddings.weight": (None, "embedding.position_embeddings.weight"),
    "layers.1.self_attention.linear_qkv.bias": (1, "self_attention.linear_qkv.bias"),
    "layers.4.mlp.linear_fc1.bias": (4, "mlp.linear_fc1.bias"),
    "layers.4.input_layernorm.bias": (4, "input_layernorm.bias"),
    "layers.1.self_attention.q_layernorm.weight": (1, "self_attention.q_layernorm.weight"),
    "layers.4.self_attention.k_layernorm.weight": (4, "self_attention.k_layernorm.weight"),
    "layers.1.mlp.router.weight": (1, "mlp.router.weight"),
    "layers.4.mlp.router.weight": (4, "mlp.router.weight"),
    "layers.4.mlp.experts.local_experts.1.linear_fc1.weight":
        (4, "mlp.experts.local_experts.1.linear_fc1.weight"),
    "layers.1.mlp.experts.local_experts.0.linear_fc2.weight":
        (1, "mlp.experts.local_experts.0.linear_fc2.weight"),
}


def global_batch():
    """Fixed tokens and a JREG token mask that drops about a fifth of the tokens."""
    gen = torch.Generator().manual_seed(1234)
    seq = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    token_mask = torch.rand(GLOBAL_BATCH, SEQ, generator=gen) > 0.2
    return seq, token_mask


def rank_batches(dp_rank, dp_size):
    seq, token_mask = global_batch()
    per_rank = GLOBAL_BATCH // dp_size
    seq = seq[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    token_mask = token_mask[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    batches = []
    for start in range(0, per_rank, MICRO_BATCH):
        s = seq[start:start + MICRO_BATCH]
        batches.append({
            "tokens": s[:, :-1].contiguous(),
            "labels": s[:, 1:].contiguous(),
            "loss_mask": torch.ones(MICRO_BATCH, SEQ),
            "position_ids": torch.arange(SEQ).expand(MICRO_BATCH, SEQ).contiguous(),
            "token_mask": token_mask[start:start + MICRO_BATCH],
        })
    return batches


def _local_expert_name(name, layer):
    """``mlp.experts.local_experts.G...`` (G global) -> this rank's local index, or the name
    unchanged when the rank does not hold expert G (under expert parallelism)."""
    import re

    from megatron.core import parallel_state

    match = re.match(r"(mlp\.experts\.local_experts\.)(\d+)(\..*)", name)
    if match is None or layer is None or not hasattr(layer.mlp, "num_local_experts"):
        return name
    per_rank = layer.mlp.num_local_experts
    local = int(match.group(2)) - parallel_state.get_expert_model_parallel_rank() * per_rank
    if not 0 <= local < per_rank:
        return "not on this rank"
    return f"{match.group(1)}{local}{match.group(3)}"


def tracked_grads(chunks):
    from megatron.core import parallel_state

    out = {}
    for chunk in chunks:
        module = chunk.module
        layers = {layer.layer_number: layer for layer in module.decoder.layers}
        for key, (layer_number, name) in TRACKED.items():
            owner = module if layer_number is None else layers.get(layer_number)
            if owner is None:
                continue
            params = dict(owner.named_parameters())
            name = _local_expert_name(name, owner)
            if name not in params:
                continue
            if key == "output_layer.weight" and module.share_embeddings_and_output_weights:
                continue  # tied: the last stage's copy of the embedding, checked through it
            param = params[name]
            out[key] = {
                "grad": param.main_grad.detach().clone(),
                "tp": bool(getattr(param, "tensor_model_parallel", False)),
                "dim": int(getattr(param, "partition_dim", -1)),
                "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
                # SwiGLU's fc1 shard is [gate part; up part] of this rank
                "glu": name.endswith("linear_fc1.weight") and module.config.gated_linear_unit,
            }
    return out


def run_task(task, ckpt_dir, out_dir):
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
    from megatron_jreg.model.builder import build_model, transformer_config
    from megatron_jreg.model.jreg_layer import JregTracker
    from megatron_jreg.training.step import forward_backward

    # a family's flags over the tiny preset (Llama form without them)
    model_cfg = ModelConfig.from_preset("tiny", vocab_size=VOCAB, seq_length=SEQ,
                                        **task.get("model", {}))
    parallel = ParallelConfig(**task.get("parallel", {}))
    initialize_model_parallel(model_cfg, parallel)
    seed_everything(1234)
    config = transformer_config(model_cfg, parallel)
    tracker = JregTracker(JregConfig(lam=task.get("lam", 1.0), alpha=0.5), model_cfg.num_layers,
                          sequence_parallel=parallel.sequence_parallel)
    chunks = build_model(model_cfg, parallel, tracker, config)
    ckpt_dir = os.path.join(ckpt_dir, task.get("family", "llama"))

    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    if task.get("save"):
        os.makedirs(ckpt_dir, exist_ok=True)
        dist_checkpointing.save(sharded, ckpt_dir)
    else:
        loaded = dist_checkpointing.load(sharded, ckpt_dir)
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"model{i}"])

    if task.get("manual"):
        return run_manual(chunks[0], model_cfg, tracker, out_dir, task)

    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
              for i, chunk in enumerate(chunks)]
    config.finalize_model_grads_func = finalize_model_grads
    for chunk in chunks:
        chunk.zero_grad_buffer()

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    result = forward_backward(chunks, rank_batches(dp_rank, dp_size), SEQ, MICRO_BATCH, tracker)
    result["grads"] = tracked_grads(chunks)
    rank = torch.distributed.get_rank()
    torch.save(result, os.path.join(out_dir, f"{task['name']}.rank{rank}.pt"))
    torch.distributed.barrier()


def run_manual(model, model_cfg, tracker, out_dir, task):
    """Single rank, no schedule, no carrier: capture each layer's input and output with
    hooks and backpropagate mean_mb(CE + lambda * sum_l w_l Psi_l) with plain autograd."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_jreg.jreg import layer_weights
    from megatron_jreg.model.builder import causal_attention_mask
    from megatron_jreg.ops import displacement

    for layer in model.decoder.layers:
        layer.jreg_tracker = None
    captured = {}

    def hook(layer, args, kwargs, output):
        h_in = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        captured[layer.layer_number] = (h_in, output[0])

    for layer in model.decoder.layers:
        layer.register_forward_hook(hook, with_kwargs=True)
    weights = layer_weights(model_cfg.num_layers, tracker.config.alpha, tracker.config.weighting)
    batches = rank_batches(0, 1)
    # a mixture-of-experts layer adds its load-balancing loss in backward at this scale:
    # here the mean over micro-batches, as the loss below
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / len(batches)))
    psi_sum = torch.zeros(model_cfg.num_layers, dtype=torch.float64)
    total_loss = 0.0
    for batch in batches:
        captured.clear()
        per_token = model(batch["tokens"], batch["position_ids"], causal_attention_mask(SEQ),
                          labels=batch["labels"])
        ce = (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        psi = torch.stack([displacement(*captured[l], mask=batch["token_mask"].t())
                           for l in range(1, model_cfg.num_layers + 1)])
        loss = (ce + tracker.config.lam * (weights * psi).sum()) / len(batches)
        loss.backward()
        psi_sum += psi.detach().double()
        total_loss += float(ce) / len(batches)
    grads = {}
    layers = {layer.layer_number: layer for layer in model.decoder.layers}
    for key, (layer_number, name) in TRACKED.items():
        owner = model if layer_number is None else layers[layer_number]
        params = dict(owner.named_parameters())
        if name in params:
            grads[key] = {"grad": params[name].grad.detach().clone(), "tp": False, "dim": -1,
                          "tp_rank": 0}
    result = {"lm_loss": total_loss, "psi": (psi_sum / len(batches)).tolist(), "R": None,
              "microbatches": None, "grads": grads}
    torch.save(result, os.path.join(out_dir, f"{task['name']}.rank0.pt"))


def main():
    spec = json.load(open(sys.argv[1]))
    initialize_distributed()
    for task in spec["tasks"]:
        run_task(task, spec["ckpt_dir"], spec["out_dir"])


if __name__ == "__main__":
    main()
