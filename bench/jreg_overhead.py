"""Step time and memory of a training step of the real model (megatron-core GPTModel with
JREG layers): JREG off, measuring only (lambda = 0, the baseline's telemetry), JREG through
the fused op, and JREG through the PyTorch reference.

    python bench/jreg_overhead.py                   # CPU: bf16, small model
    python bench/jreg_overhead.py --device cuda     # GPU: torch.cuda.max_memory_allocated

Time: one process (one rank, DDP-wrapped as in training) builds the model once; a step of a
variant sets that variant's tracker on every JREG layer (None for off), so the variants
share weights, batch, heap and threads and differ only in JREG's work. After a warm-up
step of each and ``--warmup`` untimed rounds, each of ``--timed-steps`` rounds runs one
step of every variant, in an order that changes per round so that each variant follows
each other one equally often (a Williams Latin square): load from other work lands on all
of them alike. Step time is the median over rounds with [min-max]; "x off" is the ratio of
medians, with the range of the per-round ratios; "fastest" is the ratio of the fastest
steps (the least disturbed by other work).

On CPU glibc hands freed memory back to the system and the next step faults it in again,
page by page; how much depends on the heap's layout, not on the work (in one run a
lambda = 0 step, which adds almost no work, faulted 754K pages against 468K for JREG off).
The timing process therefore asks glibc to keep freed memory, as the caching allocator does
on GPU (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``; ``--system-malloc`` leaves
glibc as it is). Page faults per step are printed, and the process's CPU time per step
beside the step time: on a machine shared with other work it moves less. ``--threads 1``
steadies both there (no thread waits at a barrier for a core another job holds).

Memory: "saved" is the bytes of distinct storages autograd keeps for backward during a
step, exact on any device. On CPU each variant runs in a fresh process of its own, with the
system allocator (build, one warm-up step, one measured step): "peak" is the process's
resident set high water mark during the step (reset through /proc/self/clear_refs) and
"step" that peak minus the resident set just before. On CUDA both come from the caching
allocator's allocated bytes, measured per variant in the timing process (what ran before
does not change them).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# Run from a checkout, use that checkout's package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # one_device_model


VARIANTS = ("off", "measure", "fused", "torch")
TARGET = 1.03  # fused within 3% of JREG off
# Freed memory stays in the process (no munmap, no trim): 16 GiB thresholds.
KEEP_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(16 << 30),
                     "MALLOC_TRIM_THRESHOLD_": str(16 << 30)}


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


def williams_orders(n: int):
    """n orders of range(n) in which each element directly follows each other one once (n
    even; for odd n each pair at most twice over the n orders)."""
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    return [[(x + r) % n for x in first] for r in range(n)]


def _tracker(variant: str, num_layers: int):
    from megatron_jreg.config.model import JregConfig
    from megatron_jreg.model.jreg_layer import JregTracker

    if variant == "off":
        return None
    if variant == "measure":  # lambda = 0: metrics only, no gradient
        return JregTracker(JregConfig(lam=0.0, alpha=1.0, impl="auto"), num_layers)
    return JregTracker(JregConfig(lam=1.0, alpha=1.0, impl=variant), num_layers)


def _model(args, tracker, device):
    """(model chunks, step(tracker) -> result) for the benchmark's model and batch."""
    import one_device_model

    from megatron_jreg.config.model import ModelConfig, ParallelConfig
    from megatron_jreg.training.step import forward_backward

    model_cfg = ModelConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
        seq_length=args.seq, vocab_size=args.vocab, bf16=args.bf16,
    )
    _, chunks = one_device_model.build(model_cfg, ParallelConfig(), tracker, device)
    batch = one_device_model.random_batch(args.vocab, args.micro_batch, args.seq, device)

    def step(step_tracker):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        return forward_backward(chunks, [batch], args.seq, args.micro_batch, step_tracker)

    return chunks, step


def _memory(step, device) -> dict:
    """MiB figures of one call of ``step`` (a warmed-up training step)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        _reset_rss_peak()
        before = _status_kib("VmRSS") * 1024
        step()
        peak = _status_kib("VmHWM") * 1024
    saved = _saved_for_backward_bytes(step)
    mib = 1024 * 1024
    return {"peak_mib": peak / mib, "saved_mib": saved / mib, "step_mib": (peak - before) / mib}


def memory_child(args) -> dict:
    """CPU: one variant in a fresh process (the resident set depends on what ran before)."""
    import one_device_model

    device = one_device_model.start(args.device)
    tracker = _tracker(args.variant, args.layers)
    _, step = _model(args, tracker, device)
    step(tracker)  # warm-up: gradient buffers, allocator pools, lazy init
    return _memory(lambda: step(tracker), device)


def timing_child(args) -> dict:
    """Every variant on one model, interleaved rounds: seconds and page faults per step."""
    import one_device_model

    device = one_device_model.start(args.device)
    import torch

    from megatron_jreg.model.jreg_layer import JregTransformerLayer

    if args.threads:
        torch.set_num_threads(args.threads)
    trackers = {v: _tracker(v, args.layers) for v in VARIANTS}
    chunks, step = _model(args, trackers["fused"], device)
    layers = [m for chunk in chunks for m in chunk.modules() if isinstance(m, JregTransformerLayer)]

    def run(variant):
        tracker = trackers[variant]
        for layer in layers:
            layer.jreg_tracker = tracker
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.process_time()
        t0 = time.perf_counter()
        result = step(tracker)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu
        return seconds, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults, result

    results = {v: run(v)[-1] for v in VARIANTS}  # warm-up: one step of each
    memory = None
    if device.type == "cuda":  # allocated bytes do not depend on what ran before
        memory = {v: _memory(lambda v=v: run(v), device) for v in VARIANTS}
    times, cpu, faults = ({v: [] for v in VARIANTS} for _ in range(3))
    orders = williams_orders(len(VARIANTS))
    for r in range(args.warmup + args.timed_steps):
        for i in orders[r % len(orders)]:
            v = VARIANTS[i]
            seconds, cpu_seconds, page_faults, _ = run(v)
            if r >= args.warmup:
                times[v].append(seconds)
                cpu[v].append(cpu_seconds)
                faults[v].append(page_faults)
    return {"times": times, "cpu": cpu, "faults": faults, "threads": torch.get_num_threads(),
            "memory": memory,
            "results": {v: {"lm_loss": r["lm_loss"], "R": r.get("R")} for v, r in results.items()}}


def _run_child(argv, env=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__)] + argv
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{' '.join(argv[:4])} "
                         f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def ratios(values, base):
    return [x / y for x, y in zip(values, base)]


def _spread(values, fmt="{:.3f}") -> str:
    return f"[{fmt.format(min(values))}-{fmt.format(max(values))}]"


def report(args, memory, timing, load_start, load_end) -> None:
    times, cpu, faults = timing["times"], timing["cpu"], timing["faults"]
    on_cpu = args.device == "cpu"
    what = "peak resident set (VmHWM)" if on_cpu else "torch.cuda.max_memory_allocated"
    setup = (f"{timing['threads']} threads, " + ("system malloc" if args.system_malloc
                                                 else "glibc keeps freed memory")) if on_cpu else ""
    loads = [", ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end)]
    print(f"one training step, L={args.layers} h={args.hidden} s={args.seq} b={args.micro_batch} "
          f"vocab={args.vocab} {'bf16' if args.bf16 else 'fp32'} on {args.device}"
          + (f" ({setup})" if setup else "")
          + f"; {args.timed_steps} interleaved rounds after {args.warmup} untimed")
    print(f"  load average (1, 5, 15 min): {loads[0]} at start, {loads[1]} at end")
    print("  step time: median [min-max] over rounds; x off: ratio of medians [per-round min-max]; "
          "fastest: ratio of the fastest steps"
          + ("; CPU: the process's CPU time per step, the same "
             "way; page faults per step (median)" if on_cpu else ""))
    wall_off, cpu_off = statistics.median(times["off"]), statistics.median(cpu["off"])
    for v in VARIANTS:
        wall = statistics.median(times[v])
        line = (f"  JREG {v:7s}  step time {wall:7.3f} s ({wall / wall_off:5.3f}x off)  "
                f"{_spread(times[v])} s  {_spread(ratios(times[v], times['off']))}x  "
                f"fastest {min(times[v]) / min(times['off']):5.3f}x")
        if on_cpu:
            line += (f"   CPU {statistics.median(cpu[v]):7.3f} s "
                     f"({statistics.median(cpu[v]) / cpu_off:5.3f}x) "
                     f"{_spread(ratios(cpu[v], cpu['off']))}x  {statistics.median(faults[v]):7.0f} "
                     "faults")
        r = timing["results"][v]
        print(line + f"  loss {r['lm_loss']:.4f}"
              + (f"  R {r['R']:.4f}" if r["R"] is not None else ""))
    where = "each variant in a fresh process" if on_cpu else "the timing process"
    print(f"  memory, {where}: saved for backward (exact); {what}")
    base = memory["off"]
    for v in VARIANTS:
        m = memory[v]
        extra = m["peak_mib"] - base["peak_mib"]
        print(f"  JREG {v:7s}  saved {m['saved_mib']:8.1f} MiB "
              f"({100 * (m['saved_mib'] / base['saved_mib'] - 1):+6.2f}%)"
              f"   peak {m['peak_mib']:9.1f} MiB   step {m['step_mib']:9.1f} MiB   "
              f"vs off {extra:+8.1f} MiB ({100 * extra / base['peak_mib']:+6.2f}% of peak)")
    fused = statistics.median(times["fused"]) / wall_off
    line = (f"  fused vs off: step time {fused:.3f}x ({'met' if fused <= TARGET else 'NOT met'}), "
            f"fastest step {min(times['fused']) / min(times['off']):.3f}x")
    if on_cpu:
        fused_cpu = statistics.median(cpu["fused"]) / cpu_off
        line += f", CPU time {fused_cpu:.3f}x ({'met' if fused_cpu <= TARGET else 'NOT met'})"
    print(line + f"; target <= {TARGET}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--timed-steps", type=int, default=11,
                        help="timed rounds, one step of each variant per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU: torch.set_num_threads for the timed steps (1 on a shared "
                             "machine)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="CPU: time with glibc's own settings")
    parser.add_argument("--fp32", dest="bf16", action="store_false", help="fp32 instead of bf16")
    parser.add_argument("--child", choices=["memory", "timing"], help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        result = memory_child(args) if args.child == "memory" else timing_child(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("jreg_overhead: --device cuda skipped, no CUDA device visible")
            return

    load_start = os.getloadavg()
    argv = sys.argv[1:]
    env = None
    if args.device == "cpu" and not args.system_malloc:
        env = dict(os.environ, **KEEP_FREED_MEMORY)
    # one process at a time: no build or step overlaps another
    timing = _run_child(["--child", "timing"] + argv, env=env)
    memory = timing["memory"] or {v: _run_child(["--child", "memory", "--variant", v] + argv)
                                  for v in VARIANTS}
    report(args, memory, timing, load_start, os.getloadavg())


if __name__ == "__main__":
    main()
