"""One rank of the context-parallel attention check (tests/model/test_cp_attention.py):
every rank builds the same full-sequence query, key, value and output gradient, takes its
two chunks, runs model.context_parallel over the gloo group and writes, as JSON to
OUT/rank_R.json, the largest difference of its output and of its q, k, v gradients from
full-sequence SDPA's, per case. Run under ``torchrun --standalone --nproc_per_node CP``."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_jreg.model import context_parallel as cp
from megatron_jreg.ops.context_chunks import local_part

# (name, query heads, key/value groups, key padding)
CASES = [("causal", 4, 4, False), ("gqa", 4, 2, False), ("gqa_padding", 4, 2, True)]


def reference(q, k, v, gqa, key_valid):
    """Full-sequence causal SDPA, K/V expanded to the query heads (no enable_gqa)."""
    s = q.shape[2]
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
    if key_valid is not None:
        mask = mask & key_valid[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25)


def main(out_dir):
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(size)))
    seq, batch, hn = 8 * size, 2, 16
    result = {}
    for name, heads, groups, padded in CASES:
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(batch, heads, seq, hn, generator=gen, dtype=torch.float64)
        k = torch.randn(batch, groups, seq, hn, generator=gen, dtype=torch.float64)
        v = torch.randn(batch, groups, seq, hn, generator=gen, dtype=torch.float64)
        grad = torch.randn(batch, heads, seq, hn, generator=gen, dtype=torch.float64)
        key_valid = None
        if padded:  # each sample's last tokens are padding (the first is never)
            lengths = torch.tensor([seq - 3, seq // 2 + 1])
            key_valid = torch.arange(seq)[None, :] < lengths[:, None]
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = reference(*full, heads != groups, key_valid)
        expected.backward(grad)

        part = lambda t: local_part(t, 2, size, rank)  # noqa: E731
        mine = [part(t).clone().requires_grad_() for t in (q, k, v)]
        # keys and values travel as megatron holds them, [s, b, ng, hn]
        kv = [cp.gather_sequence(t.permute(2, 0, 1, 3), group).permute(1, 2, 0, 3)
              for t in mine[1:]]
        out = cp.attend(mine[0], *kv, size, rank, scale=0.25, gqa=heads != groups,
                        key_valid=key_valid)
        out.backward(part(grad))
        diffs = {"out": (out - part(expected)).abs().max().item()}
        for label, local, whole in zip("qkv", mine, full):
            diffs["grad_" + label] = (local.grad - part(whole.grad)).abs().max().item()
        diffs["finite"] = bool(torch.isfinite(out).all())
        result[name] = diffs
    with open(os.path.join(out_dir, f"rank_{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
