"""Time of the per-token displacement op, fused kernel vs PyTorch reference, forward and
forward+backward, measured in one run; on CUDA also the achieved bandwidth.

    python bench/displacement_op.py                          # CPU, fp32, [2048, 4, 3072]
    python bench/displacement_op.py --device cuda --dtype bf16

Bytes moved (the floor): forward reads a and b; backward reads a and b and writes both
gradients. Per-token outputs (psi, 3 saved scalars, the incoming gradient) are counted too.
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, warmup: int, iters: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    """The device's theoretical DRAM bandwidth from its memory clock and bus width."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate


def copy_bandwidth_gbs(device: torch.device, nbytes: int, warmup: int, iters: int) -> float:
    """What a device-to-device copy achieves: the practical ceiling for a streaming op."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), device, warmup, iters)
    return 2 * nbytes / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--shape", type=int, nargs=3, default=[2048, 4, 3072], metavar=("S", "B", "H"))
    parser.add_argument("--iters", type=int, default=None, help="timed calls (default 5 on CPU, 50 on CUDA)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads on CPU")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("fp32" if device.type == "cpu" else "bf16")]
    iters = args.iters or (5 if device.type == "cpu" else 50)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not fused_available(device):
        raise SystemExit(f"the fused kernel is not built for {device.type}; reinstall the package")

    s, b, h = args.shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(s, b, h, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    y = (x.detach() + 0.3 * torch.randn(s, b, h, device=device, dtype=dtype, generator=gen)).requires_grad_(True)
    grad = torch.rand(s, b, device=device, dtype=torch.float32, generator=gen)

    def forward(impl):
        with torch.no_grad():
            token_displacement(x, y, impl=impl)

    def forward_backward(impl):
        psi = token_displacement(x, y, impl=impl)
        torch.autograd.grad(psi, (x, y), grad)

    elem = x.element_size()
    tokens, n = s * b, s * b * h
    fwd_bytes = 2 * n * elem + tokens * 4 * (1 + 3)
    bwd_bytes = 4 * n * elem + tokens * 4 * (1 + 3)

    where = f"{device.type} ({torch.get_num_threads()} threads)" if device.type == "cpu" else torch.cuda.get_device_name(device)
    print(f"token_displacement  [s={s}, b={b}, h={h}] {str(dtype).replace('torch.', '')} on {where}, median of {iters}")
    results = {}
    for impl in ("fused", "torch"):
        results[impl] = (
            _time(lambda: forward(impl), device, args.warmup, iters),
            _time(lambda: forward_backward(impl), device, args.warmup, iters),
        )
        fwd, fwdbwd = results[impl]
        line = f"  {impl:6s} forward {fwd * 1e3:9.2f} ms   forward+backward {fwdbwd * 1e3:9.2f} ms"
        line += f"   ({fwd_bytes / fwd / 1e9:7.1f} GB/s fwd, {(fwd_bytes + bwd_bytes) / fwdbwd / 1e9:7.1f} GB/s fwd+bwd)"
        print(line)
    ratio_fwd = results["fused"][0] / results["torch"][0]
    ratio = results["fused"][1] / results["torch"][1]
    print(f"  ratio fused/reference: forward {ratio_fwd:.3f}, forward+backward {ratio:.3f} "
          f"(speed-up {1 / ratio:.2f}x)")

    if device.type == "cuda":
        fused_fwd, fused_fwdbwd = results["fused"]
        bwd = max(fused_fwdbwd - fused_fwd, 1e-12)
        achieved = {"forward": fwd_bytes / fused_fwd / 1e9, "backward": bwd_bytes / bwd / 1e9}
        peak = peak_bandwidth_gbs(device)
        copy = copy_bandwidth_gbs(device, 2 * n * elem, args.warmup, iters)
        for phase, gbs in achieved.items():
            line = f"  fused {phase:8s} {gbs:8.1f} GB/s"
            if peak:
                line += f" = {100 * gbs / peak:5.1f}% of peak {peak:.0f} GB/s"
            line += f", {100 * gbs / copy:5.1f}% of a device copy ({copy:.0f} GB/s)"
            print(line)


if __name__ == "__main__":
    main()
