"""Each fix of megatron_jreg.platform.mcore_fixes on its own, before and after, in a fresh
process (the fixes are process-global). Prints the observations as JSON."""

import json
import multiprocessing
import os
import queue
import sys
import tempfile

import torch
import torch.distributed as dist

from megatron_jreg.platform import mcore_fixes

obs = {}

# (1) CheckpointWithoutOutput's fp8 flag without Transformer Engine (no CPU platform yet:
# this path needs no device redirection)
from megatron.core.tensor_parallel import random as mrandom  # noqa: E402

norm = torch.nn.RMSNorm(8)
x = torch.randn(3, 8)
obs["fp8_before"] = mrandom.CheckpointWithoutOutput().fp8
try:
    mrandom.CheckpointWithoutOutputFunction.apply(norm, mrandom.CheckpointWithoutOutput(), x)
    obs["recompute_before"] = "ran"
except NameError as err:
    obs["recompute_before"] = f"NameError: {err}"
mcore_fixes.fix_checkpoint_without_output_fp8()
obs["fp8_after"] = mrandom.CheckpointWithoutOutput().fp8
out = mrandom.CheckpointWithoutOutputFunction.apply(norm, mrandom.CheckpointWithoutOutput(), x)
obs["recompute_after_equals_norm"] = torch.equal(out, norm(x))

# The rest saves checkpoints and builds optimizers: CPU device redirection (only that).
from megatron_jreg.platform import cpu  # noqa: E402

cpu.activate()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402

parallel_state.initialize_model_parallel(create_gloo_process_groups=True)
mrandom.model_parallel_cuda_manual_seed(1)

# (2) the writer's result queue: in-process, no Manager server process
obs["queue_before"] = repr(filesystem_async._results_queue)
mcore_fixes.fix_checkpoint_writer_queue()
obs["queue_after_is_local"] = isinstance(filesystem_async._results_queue, queue.Queue)
from megatron.core.dist_checkpointing import ShardedTensor  # noqa: E402

root = tempfile.mkdtemp()
for sub in ("q", "o"):
    os.makedirs(os.path.join(root, sub))
t = torch.arange(6.0)
dist_checkpointing.save({"t": ShardedTensor.from_rank_offsets("t", t)}, os.path.join(root, "q"))
back = dist_checkpointing.load({"t": ShardedTensor.from_rank_offsets("t", torch.empty(6))},
                               os.path.join(root, "q"))
obs["queue_round_trip"] = torch.equal(back["t"], t)
obs["child_processes_after_save"] = len(multiprocessing.active_children())


# (3) DistributedOptimizer with torch Adam: a fresh optimizer's state_dict, and per-param
# step tensors after a load
def build():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=32, max_sequence_length=8)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2,
                                                 use_distributed_optimizer=True), [ddp])
    return ddp, opt


def step(ddp, opt):
    ddp.zero_grad_buffer()
    opt.zero_grad()
    tokens = torch.arange(8).unsqueeze(0) % 32
    loss = ddp(tokens, torch.arange(8).unsqueeze(0), None, labels=tokens).sum()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()


ddp, opt = build()
try:
    opt.state_dict()
    obs["fresh_state_dict_before"] = "ok"
except AssertionError:
    obs["fresh_state_dict_before"] = "AssertionError"
mcore_fixes.fix_distributed_optimizer_checkpoints()
obs["fresh_state_dict_after_step"] = [g["step"]
                                      for g in opt.state_dict()["optimizer"]["param_groups"]]
for _ in range(3):
    step(ddp, opt)
meta = {"distrib_optim_sharding_type": "fully_reshardable"}
state = {"model": ddp.module.sharded_state_dict()}
state["optimizer"] = opt.sharded_state_dict(state, metadata=meta)
dist_checkpointing.save(state, os.path.join(root, "o"), content_metadata=meta)
ddp2, opt2 = build()
state2 = {"model": ddp2.module.sharded_state_dict()}
state2["optimizer"] = opt2.sharded_state_dict(state2, is_loading=True, metadata=meta)
loaded = dist_checkpointing.load(state2, os.path.join(root, "o"))
ddp2.module.load_state_dict(loaded["model"])
opt2.load_state_dict(loaded["optimizer"])
steps = [s["step"] for s in opt2.optimizer.state.values()]
obs["loaded_steps"] = sorted({float(s) for s in steps})
obs["step_tensors_distinct"] = len({id(s) for s in steps}) == len(steps)
step(ddp, opt)
step(ddp2, opt2)
obs["resumed_step_matches"] = all(torch.equal(a, b) for a, b in
                                  zip(ddp.module.parameters(), ddp2.module.parameters()))
# (4) the MoE router's gating GEMM without Transformer Engine
from megatron.core.transformer.moe import moe_utils  # noqa: E402

w = torch.randn(4, 8, requires_grad=True)
h = torch.randn(5, 8, requires_grad=True)
try:
    moe_utils.router_gating_linear(h, w, None, torch.float32)
    obs["router_before"] = "ran"
except NameError as err:
    obs["router_before"] = f"NameError: {err}"
mcore_fixes.fix_moe_router_without_te()
logits = moe_utils.router_gating_linear(h, w, None, torch.float32)
logits.sum().backward()
obs["router_after_equals_mm"] = torch.allclose(logits, h @ w.t())
obs["router_grad_equals_mm"] = torch.allclose(w.grad, torch.ones(5, 4).t() @ h)

print("CHECKS " + json.dumps(obs))
sys.stdout.flush()
