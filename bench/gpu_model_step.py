"""Training steps of one model on one device: tokens/s, TFLOP/s and MFU, peak memory.
``--attention-backend`` picks the core attention as the trainer's flag does.

Builds a JREG model of a preset's dimensions (optionally fewer layers) the way the trainer
does (megatron-core GPTModel, the trainer's DDP wrap and optimizer builder, distributed
optimizer, bf16), runs warm-up steps and
then times ``--timed-steps`` full steps (forward, backward, optimizer), median. Prints a
human line and a ``RESULT {json}`` line (read by bench/gpu_checks.py).

    python bench/gpu_model_step.py --device cuda --preset 3b --layers 2 --micro-batch 1 \
        --transformer-impl local --recompute-modules layernorm
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the package
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # one_device_model

# bf16 dense peak of the GPU, TFLOP/s (NVIDIA's datasheet figures, without sparsity)
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def peak_tflops(name: str):
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


def run(args) -> dict:
    import one_device_model

    device = one_device_model.start(args.device)
    import torch

    from megatron_jreg.config.model import (
        JregConfig,
        ModelConfig,
        ParallelConfig,
        resolve_transformer_impl,
    )
    from megatron_jreg.config.run import OptimConfig
    from megatron_jreg.model.builder import core_attention
    from megatron_jreg.model.jreg_layer import JregTracker
    from megatron_jreg.training.metrics import model_flops_per_token
    from megatron_jreg.training.optimizer import build_optimizer
    from megatron_jreg.training.step import forward_backward

    overrides = {"vocab_size": args.vocab, "bf16": args.bf16,
                 "transformer_impl": resolve_transformer_impl(args.transformer_impl)[0],
                 "attention_backend": args.attention_backend}
    if args.layers:
        overrides["num_layers"] = args.layers
    if args.seq:
        overrides["seq_length"] = args.seq
    model_cfg = ModelConfig.from_preset(args.preset, **overrides)
    recompute = {}
    if args.recompute_modules:
        recompute = {"recompute_granularity": "selective",
                     "recompute_modules": args.recompute_modules}
    tracker = JregTracker(JregConfig(lam=args.jreg_lambda, alpha=1.0), model_cfg.num_layers)
    config, chunks = one_device_model.build(model_cfg, ParallelConfig(**recompute), tracker, device,
                                            float16_module=args.bf16, distributed_optimizer=True)
    # the trainer's optimizer (AdamW, megatron's distributed optimizer)
    optimizer = build_optimizer(chunks, config, model_cfg,
                                OptimConfig(lr=1e-4, clip_grad=1.0, use_distributed_optimizer=True))
    config.grad_scale_func = optimizer.scale_loss

    s, b = model_cfg.seq_length, args.micro_batch
    batch = one_device_model.random_batch(args.vocab, b, s, device)

    def step():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(chunks, [batch], s, b, tracker)
        optimizer.step()
        return out

    for _ in range(args.warmup):
        out = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        out = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = b * s / step_s
    tflops = model_flops_per_token(model_cfg, model_cfg.padded_vocab_size()) * tokens_per_s / 1e12
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_tflops(name) if device.type == "cuda" else None
    loss = out["lm_loss"]
    return {
        "preset": args.preset, "layers": model_cfg.num_layers, "seq": s, "micro_batch": b,
        "transformer_impl": model_cfg.transformer_impl, "attention": core_attention(model_cfg)[0],
        "jreg_lambda": args.jreg_lambda, "recompute": args.recompute_modules or [],
        "bf16": args.bf16, "device": name, "step_s": step_s, "tokens_per_s": tokens_per_s,
        "tflops": tflops, "mfu": tflops / peak if peak else None,
        "peak_mem_gib": (torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda"
                         else None),
        "lm_loss": loss if loss is not None and math.isfinite(loss) else None,
        "psi_finite": all(math.isfinite(p) for p in out["psi"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="170m", choices=["tiny", "170m", "1b", "3b"])
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    parser.add_argument("--seq", type=int, default=None,
                        help="sequence length (default the preset's)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--transformer-impl", default="auto",
                        choices=["auto", "local", "transformer_engine"])
    parser.add_argument("--attention-backend", default="auto",
                        choices=["auto", "flash", "fused", "unfused", "local", "sdpa"],
                        help="the trainer's --attention-backend (unfused: megatron-core's own)")
    parser.add_argument("--recompute-modules", nargs="*", default=None,
                        help="selective recompute of these modules (e.g. layernorm core_attn mlp)")
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 instead of bf16")
    parser.add_argument("--jreg-lambda", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timed-steps", type=int, default=5)
    args = parser.parse_args()
    r = run(args)
    mfu = f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] is not None else ""
    mem = f", peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
    print(f"{r['preset']} x{r['layers']} layers, s={r['seq']} b={r['micro_batch']}, "
          f"{r['transformer_impl']}, "
          f"attention {r['attention']}, lambda {r['jreg_lambda']}, "
          f"recompute {r['recompute'] or 'none'}, {'bf16' if r['bf16'] else 'fp32'} on "
          f"{r['device']}: "
          f"step {r['step_s'] * 1e3:.1f} ms, {r['tokens_per_s']:,.0f} tokens/s, "
          f"{r['tflops']:.1f} TFLOP/s{mfu}{mem}, loss {r['lm_loss']}")
    print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
