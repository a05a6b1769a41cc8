"""Exercise each CPU redirection of megatron_jreg.platform.cpu in a fresh process and print
the observations as JSON (the patches are process-global, so pytest runs this apart)."""

import json
import queue

import torch

from megatron_jreg.platform import cpu

# where device="cuda" lands before the redirection: an error on a CPU build of torch, a GPU
# on a CUDA machine; never the CPU
before = {}
try:
    before["zeros_cuda"] = torch.zeros(1, device="cuda").device.type
except (RuntimeError, AssertionError):
    before["zeros_cuda"] = "error"

cpu.activate()
cpu.activate()  # idempotent

from megatron.core.tensor_parallel import random as mrandom  # noqa: E402

obs = {"before": before}
obs["factories"] = [
    getattr(torch, name)(*args, device=dev).device.type
    for name, args in (("zeros", (2,)), ("ones", (2,)), ("empty", (2,)), ("full", ((2,), 1.0)),
                       ("arange", (3,)), ("tensor", ([1.0],)))
    for dev in ("cuda", 0, torch.device("cuda", 0))
]
obs["empty_like"] = [torch.empty_like(torch.ones(2), device=dev).device.type
                     for dev in ("cuda", 0, torch.device("cuda", 0))]
from megatron.core.dist_checkpointing.mapping import ShardedTensor  # noqa: E402

sharded = ShardedTensor.from_rank_offsets("x", torch.ones(2))
sharded.data = None
sharded.init_data("cuda")  # the fully parallel load's exchange buffers
obs["sharded_init_data"] = sharded.data.device.type
# a pinned host tensor (megatron-core's context-parallel RoPE chunk ids): an ordinary one
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank  # noqa: E402


class _TwoRanks:  # rank 1 of a CP group of 2: chunks 1 and 2 of 4
    size, rank = staticmethod(lambda: 2), staticmethod(lambda: 1)


obs["pinned_tensor"] = torch.tensor([1], device="cpu", pin_memory=True).tolist()
obs["cp_rope_chunks"] = get_pos_emb_on_this_cp_rank(torch.arange(8.0), 0, _TwoRanks()).tolist()
obs["current_device"] = str(torch.cuda.current_device())
obs["synchronize"] = torch.cuda.synchronize() is None
t = torch.ones(3)
obs["tensor_cuda_identity"] = t.cuda() is t
obs["types"] = [torch.ones(1).type(), torch.ones(1, dtype=torch.bfloat16).type(),
                torch.ones(1, dtype=torch.float16).type(),
                torch.ones(1).type(torch.float64).dtype.__str__()]

# RNG tracker: named CPU streams, default stream untouched by a fork
torch.manual_seed(7)
mrandom.model_parallel_cuda_manual_seed(7, tp_rank=0, ep_rank=0, etp_rank=0)
tracker = mrandom.get_cuda_rng_tracker()
obs["tracker_class"] = type(tracker).__name__
default_state = torch.get_rng_state()
with tracker.fork():
    a = torch.rand(4)
obs["default_state_restored"] = torch.equal(default_state, torch.get_rng_state())
with tracker.fork():
    b = torch.rand(4)
obs["fork_stream_advances"] = not torch.equal(a, b)
plain = torch.rand(4)
torch.set_rng_state(default_state)
obs["fork_differs_from_default"] = not torch.equal(a, plain)
obs["cuda_rng_state_empty"] = mrandom._get_cuda_rng_state().numel() == 0

# device redirection only: no megatron-core fix rides on the CPU platform
from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: E402

from megatron_jreg.platform import mcore_fixes  # noqa: E402

obs["mcore_fixes_applied"] = mcore_fixes.is_applied()
obs["checkpoint_without_output_fp8"] = mrandom.CheckpointWithoutOutput().fp8
obs["writer_queue_is_local"] = isinstance(filesystem_async._results_queue, queue.Queue)
print("CHECKS " + json.dumps(obs))
