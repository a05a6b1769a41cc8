"""Time of the fused displacement op against a plain copy of the bytes it must move, and
against the PyTorch reference; on CUDA also GB/s against the device's peak.

    python bench/displacement_op.py                              # CPU: fp32 and bf16, three shapes
    python bench/displacement_op.py --device cuda --dtype bf16   # GPU: GB/s vs peak (gpu_checks)

What the op must move, n = tokens * hidden elements of e bytes:

- forward: read a and b (2 n e bytes). Its copy: a into a reused buffer (n e read, n e
  written: the same 2 n e bytes).
- backward: read a and b, write two new gradients (4 n e bytes). Its copy: a.clone() and
  b.clone() (the same bytes, into new tensors as the op's, so on CPU both pay the first
  touch of fresh pages).

Per-token values (psi, 3 saved scalars, the incoming gradient: 16 bytes a token) are left
out: under 1% of the bytes at h >= 1024. "op/copy" is the op's time as a multiple of its
copy's: 1.0x is as fast as a copy of the same bytes. Each round times every candidate
once, in an order rotated per round, so load from other work lands on all of them alike;
a figure is the median over rounds with [min-max], a ratio the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

# Run from a checkout, use that checkout's package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.ops import fused_available, token_displacement  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# [s, b, h]: 4096, 8192 and 16384 tokens at hidden 1024, 2048 (the 1b preset), 3072 (3b)
SHAPES = [(4096, 1, 1024), (2048, 4, 2048), (2048, 8, 3072)]
CPU_TARGET = 1.5  # fwd+bwd within 1.5x a copy of the same bytes on CPU

# HBM bandwidth from the vendors' data sheets, GB/s, by device name. Order matters: the
# first name contained in torch.cuda.get_device_name wins (GH200 before H200).
PEAK_GBS = [
    ("GH200", 4000), ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350),
    ("H800", 3350), ("B200", 8000), ("B100", 8000), ("A100-SXM4-80GB", 2039),
    ("A100 80GB PCIe", 1935), ("A100", 1555), ("A800", 2039), ("L40S", 864), ("L40", 864),
    ("A10", 600), ("L4", 300), ("V100", 900),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(fn, device: torch.device, reps: int) -> float:
    """Seconds per call of ``fn``, over ``reps`` calls in a row."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def interleaved(candidates: dict, device: torch.device, rounds: int, warmup: int,
                reps: int) -> dict:
    """{name: [seconds per round]}: warm-up calls, then ``rounds`` rounds of one timing of
    each candidate, the order rotated by one each round."""
    names = list(candidates)
    for name in names:
        for _ in range(warmup):
            candidates[name]()
    _sync(device)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(_once(candidates[name], device, reps))
    return times


def spread(values, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """'median [min-max]' of values * scale."""
    v = [x * scale for x in values]
    return f"{fmt.format(statistics.median(v))} [{fmt.format(min(v))}-{fmt.format(max(v))}]"


def ratios(num, den):
    return [x / y for x, y in zip(num, den)]


def peak_bandwidth(device: torch.device):
    """(GB/s, where it came from) of the device's DRAM, or (None, why not)."""
    name = torch.cuda.get_device_name(device)
    for key, gbs in PEAK_GBS:
        if key in name:
            return float(gbs), f"data sheet, {key}"
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:  # double data rate
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    return None, f"{name!r} not in the table"


def copy_bandwidth_gbs(device: torch.device, nbytes: int, rounds: int) -> float:
    """What a large device-to-device copy achieves (read + written bytes): the practical peak."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = interleaved({"copy": lambda: dst.copy_(src)}, device, rounds, 2, 5)["copy"]
    return 2 * nbytes / statistics.median(times) / 1e9


def bench_shape(shape, dtype, device, args, reference: bool) -> dict:
    s, b, h = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s, b, h, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    y = (x.detach()
         + 0.3 * torch.randn(s, b, h, device=device, dtype=dtype,
                             generator=gen)).requires_grad_(True)
    grad = torch.rand(s, b, device=device, dtype=torch.float32, generator=gen)
    a, bb = x.detach(), y.detach()
    _, stats = torch.ops.megatron_jreg.token_displacement_fwd(a, bb)
    buffer = torch.empty_like(a)

    def fwdbwd(impl):
        psi = token_displacement(x, y, impl=impl)
        torch.autograd.grad(psi, (x, y), grad)

    candidates = {
        "fwd op": lambda: torch.ops.megatron_jreg.token_displacement_fwd(a, bb),
        "fwd copy": lambda: buffer.copy_(a),
        "bwd op": lambda: torch.ops.megatron_jreg.token_displacement_bwd(grad, a, bb, stats),
        "bwd copy": lambda: (a.clone(), bb.clone()),
        "fwd+bwd op": lambda: fwdbwd("fused"),
    }
    if reference:
        candidates["fwd+bwd torch"] = lambda: fwdbwd("torch")
    reps = 1 if device.type == "cpu" else args.reps
    t = interleaved(candidates, device, args.iters, args.warmup, reps)
    t["fwd+bwd copy"] = [f + g for f, g in zip(t["fwd copy"], t["bwd copy"])]
    n = a.numel() * a.element_size()
    return {"times": t, "bytes": {"fwd": 2 * n, "bwd": 4 * n, "fwd+bwd": 6 * n}}


def print_rows(shape, dtype_name, result) -> list:
    """Prints one shape's lines; returns its fwd+bwd op/copy ratios."""
    s, b, h = shape
    t, nbytes = result["times"], result["bytes"]
    head = f"{dtype_name} {s * b}x{h}"
    for i, phase in enumerate(("fwd", "bwd", "fwd+bwd")):
        op, copy = t[f"{phase} op"], t[f"{phase} copy"]
        gbs = nbytes[phase] / statistics.median(op) / 1e9
        print(f"  {head if i == 0 else '':15s} {phase:7s}  op {spread(op, 1e3):>23s} ms  "
              f"copy {spread(copy, 1e3):>23s} ms  op/copy {spread(ratios(op, copy)):>18s}x  "
              f"{gbs:6.1f} GB/s")
    if "fwd+bwd torch" in t:
        ratio = statistics.median(ratios(t["fwd+bwd op"], t["fwd+bwd torch"]))
        print(f"  {'':15s} ratio fused/reference: forward+backward {ratio:.3f} (speed-up "
              f"{1 / ratio:.2f}x; "
              f"the PyTorch reference takes {spread(t['fwd+bwd torch'], 1e3)} ms)")
    return ratios(t["fwd+bwd op"], t["fwd+bwd copy"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                        help="default: fp32 and bf16 on CPU, bf16 on CUDA")
    parser.add_argument("--shape", type=int, nargs=3, default=None, metavar=("S", "B", "H"),
                        help=f"one [s, b, h] instead of {SHAPES}")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed rounds (default 7 on CPU, 20 on CUDA)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10,
                        help="CUDA: calls per timing (launch cost amortised)")
    parser.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    parser.add_argument("--system-malloc", action="store_true",
                        help="CPU: time with glibc's own settings (it returns freed memory to the "
                        "system, and every large allocation faults its pages in again)")
    args = parser.parse_args()
    if args.device == "cpu" and not args.system_malloc:
        # keep freed memory, as the caching allocator does on GPU (as bench/jreg_overhead.py):
        # otherwise the grads' fresh pages, not the work, set the backward's time
        from jreg_overhead import KEEP_FREED_MEMORY

        if any(os.environ.get(k) != v for k, v in KEEP_FREED_MEMORY.items()):
            os.execve(sys.executable, [sys.executable] + sys.argv,
                      dict(os.environ, **KEEP_FREED_MEMORY))

    if args.device == "cuda" and not torch.cuda.is_available():
        print("displacement_op: --device cuda skipped, no CUDA device visible")
        return
    device = torch.device(args.device)
    dtypes = args.dtype or (["fp32", "bf16"] if device.type == "cpu" else ["bf16"])
    args.iters = args.iters or (7 if device.type == "cpu" else 20)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fused_available(device):
        raise SystemExit(f"the fused kernel is not built for {device.type}; reinstall the package")
    shapes = [tuple(args.shape)] if args.shape else SHAPES

    where = (f"cpu ({torch.get_num_threads()} threads)" if device.type == "cpu"
             else torch.cuda.get_device_name(device))
    load = os.getloadavg()[0]
    print(f"token_displacement on {where}: the fused op vs a plain copy of the bytes it must move "
          f"(see --help); median [min-max] of {args.iters} interleaved rounds; load average "
          f"{load:.2f} at start")
    print(f"  {'dtype tokens x h':15s} phase    time of the op, of the copy, "
          "their per-round ratio, the op's GB/s")
    fwdbwd_ratio, largest = {}, {}
    for dtype_name in dtypes:
        for k, shape in enumerate(shapes):
            # the reference is ten times slower on CPU: timed at the first shape only
            result = bench_shape(shape, DTYPES[dtype_name], device, args,
                                 reference=not args.no_reference and k == 0)
            fwdbwd = print_rows(shape, dtype_name, result)
            fwdbwd_ratio[(dtype_name, shape)] = statistics.median(fwdbwd)
            largest[dtype_name] = result
    print(f"load average {os.getloadavg()[0]:.2f} at end")
    if device.type == "cpu":
        over = [f"{d} {s}" for (d, s), r in fwdbwd_ratio.items() if r > CPU_TARGET]
        print(f"target fwd+bwd <= {CPU_TARGET}x the copy: "
              + ("met at every shape" if not over else f"NOT met at {', '.join(over)}")
              + f" (median op/copy {min(fwdbwd_ratio.values()):.2f}x to "
                f"{max(fwdbwd_ratio.values()):.2f}x)")
        return

    peak, source = peak_bandwidth(device)
    print_bandwidth(largest, peak, source, copy_bandwidth_gbs(device, 1 << 30, args.iters))


def print_bandwidth(largest: dict, peak, source: str, copy: float) -> None:
    """The fused op's GB/s at the largest shape of each dtype, against the device's peak and
    a large device-to-device copy (bench/gpu_checks.py reads these lines)."""
    for dtype_name, result in largest.items():
        print(f"  bandwidth of the fused op, {dtype_name} at the largest shape:")
        for phase, label in (("fwd", "forward"), ("bwd", "backward")):
            gbs = result["bytes"][phase] / statistics.median(result["times"][f"{phase} op"]) / 1e9
            line = f"  fused {label:8s} {gbs:8.1f} GB/s"
            if peak:
                line += f" = {100 * gbs / peak:.1f}% of peak {peak:.0f} GB/s ({source})"
            else:
                line += f" (peak unknown: {source})"
            line += f", {100 * gbs / copy:.1f}% of a 1 GiB device copy ({copy:.0f} GB/s)"
            print(line)

if __name__ == "__main__":
    main()
