"""Step time and peak memory of a training step of the real model (megatron-core GPTModel
with JREG layers): JREG off, measuring only (lambda = 0, the baseline's telemetry), JREG
through the fused op, and JREG through the PyTorch reference.

    python bench/jreg_overhead.py                   # CPU: peak RSS (VmHWM), bf16, small model
    python bench/jreg_overhead.py --device cuda     # GPU: torch.cuda.max_memory_allocated

Each variant runs in its own process (one rank, DDP-wrapped as in training): build, one
warm-up step, then the measured step. On CPU the figure is the process's resident-set high
water mark during the measured step (reset through /proc/self/clear_refs), so it covers
everything (model, gradient buffers, activations, allocator slack); "step" is that peak
minus the resident set just before the step. On CUDA it is the caching allocator's peak of
allocated bytes during the measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# Run from a checkout, use that checkout's package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # one_device_model


VARIANTS = ("off", "measure", "fused", "torch")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_rss_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one


def _saved_for_backward_bytes(step) -> int:
    """Bytes of distinct storages autograd keeps for backward during one step: the
    activation memory a variant adds, exactly and on any device (RSS is noisy on CPU)."""
    import torch

    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())


def run_variant(args) -> dict:
    """One process: build the model, warm up, measure one step. Returns MiB figures."""
    import one_device_model

    device = one_device_model.start(args.device)
    import torch

    from megatron_jreg.model.config import JregConfig, ModelConfig, ParallelConfig
    from megatron_jreg.model.jreg_layer import JregTracker
    from megatron_jreg.training.step import forward_backward

    model_cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
        seq_length=args.seq, vocab_size=args.vocab, bf16=args.bf16,
    )
    tracker = None
    if args.variant == "measure":  # lambda = 0: metrics only, no gradient
        tracker = JregTracker(JregConfig(lam=0.0, alpha=1.0, impl="auto"), model_cfg.num_layers)
    elif args.variant != "off":
        tracker = JregTracker(JregConfig(lam=1.0, alpha=1.0, impl=args.variant), model_cfg.num_layers)
    _, chunks = one_device_model.build(model_cfg, ParallelConfig(), tracker, device)
    batch = one_device_model.random_batch(args.vocab, args.micro_batch, args.seq, device)

    def step():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        return forward_backward(chunks, [batch], args.seq, args.micro_batch, tracker)

    step()  # warm-up: gradient buffers, allocator pools, lazy init
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        unit = "allocated"
    else:
        _reset_rss_peak()
        before = _status_kib("VmRSS") * 1024
        result = step()
        peak = _status_kib("VmHWM") * 1024
        unit = "rss"
    saved = _saved_for_backward_bytes(step)
    import time

    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    mib = 1024 * 1024
    return {"variant": args.variant, "unit": unit, "peak_mib": peak / mib,
            "step_s": times[len(times) // 2], "saved_mib": saved / (1024 * 1024),
            "step_mib": (peak - before) / mib, "lm_loss": result["lm_loss"],
            "R": result.get("R")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--timed-steps", type=int, default=5, help="steps timed (median)")
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 instead of bf16")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # child process
    args = parser.parse_args()

    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return

    results = {}
    for variant in VARIANTS:
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant] + sys.argv[1:]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"variant {variant} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results[variant] = json.loads(lines[-1][len("RESULT "):])

    unit = results["off"]["unit"]
    what = ("peak resident set (VmHWM) of the process" if unit == "rss"
            else "torch.cuda.max_memory_allocated")
    print(f"one training step, L={args.layers} h={args.hidden} s={args.seq} b={args.micro_batch} "
          f"vocab={args.vocab} {'bf16' if args.bf16 else 'fp32'} on {args.device}: {what}")
    off = results["off"]
    for variant in VARIANTS:
        r = results[variant]
        extra = r["peak_mib"] - off["peak_mib"]
        print(f"  JREG {variant:7s}  step time {r['step_s']:7.3f} s ({r['step_s'] / off['step_s']:5.3f}x off)   "
              f"saved for backward {r['saved_mib']:8.1f} MiB ({100 * (r['saved_mib'] / off['saved_mib'] - 1):+6.2f}%)   "
              f"peak {r['peak_mib']:9.1f} MiB   step {r['step_mib']:9.1f} MiB   "
              f"vs off {extra:+8.1f} MiB ({100 * extra / off['peak_mib']:+6.2f}% of peak)   "
              f"loss {r['lm_loss']:.4f}" + (f"  R {r['R']:.4f}" if r["R"] is not None else ""))


if __name__ == "__main__":
    main()
