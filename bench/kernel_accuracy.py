"""Accuracy of the fused displacement kernel against a float64 reference, per dtype.

psi = (1 - cos(a, b)) / 2 per token. For each dtype the inputs are drawn in fp32, rounded
to that dtype, and the same rounded values are copied to float64 for the reference
(``token_displacement_reference``, computed in float64): the figures are the kernel's own
error, not the inputs' rounding. Printed per dtype:

- psi: the largest |fused - reference| over tokens (psi lies in [0, 1]);
- grad a, grad b: the largest |fused - reference| of dpsi/da and dpsi/db under a random
  upstream gradient, divided by the largest |reference| of that gradient (the gradients
  come back in the inputs' dtype, so bf16 cannot do better than its rounding, ~4e-3).

Token norms vary over about two orders of magnitude (a random scale per token). Exit 1
when an error is above the dtype's limit (LIMITS) or not finite; the last line is
``RESULT {json}`` (read by bench/gpu_checks.py).

    python bench/kernel_accuracy.py                          # CPU: fp32 and bf16
    python bench/kernel_accuracy.py --device cuda            # fp32, bf16 and fp16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

# Run from a checkout, use that checkout's package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.ops import fused_available, token_displacement, token_displacement_reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (psi, gradients): the largest error a dtype may show; the gradients' limit is a few
# units of the dtype's rounding (they are returned in the inputs' dtype)
LIMITS = {"fp32": (1e-5, 1e-5), "bf16": (1e-5, 1e-2), "fp16": (1e-5, 2e-3)}
SHAPE = {"cpu": (256, 2, 512), "cuda": (2048, 4, 2048)}  # [s, b, h]


def inputs(shape, dtype, device, seed: int = 0):
    """(a, b, upstream gradient): b a perturbed a, token norms scaled by e^N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    s, b, h = shape
    scale = torch.exp(torch.randn(s, b, 1, generator=gen))
    a = torch.randn(s, b, h, generator=gen) * scale
    noise = torch.randn(s, b, h, generator=gen) * scale
    bb = a + 0.3 * noise
    grad = torch.rand(s, b, generator=gen)
    return a.to(device, dtype), bb.to(device, dtype), grad.to(device)


def errors(shape, dtype, device) -> dict:
    """{psi, grad_a, grad_b}: the fused kernel's largest errors against float64 (see module doc)."""
    a, b, grad = inputs(shape, dtype, device)
    fa, fb = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
    psi = token_displacement(fa, fb, impl="fused")
    ga, gb = torch.autograd.grad(psi, (fa, fb), grad)
    ra, rb = a.double().requires_grad_(True), b.double().requires_grad_(True)
    ref = token_displacement_reference(ra, rb)
    ref_ga, ref_gb = torch.autograd.grad(ref, (ra, rb), grad.double())

    def relative(x, ref_x):
        return ((x.double() - ref_x).abs().max() / ref_x.abs().max()).item()

    return {"psi": (psi.double() - ref).abs().max().item(),
            "grad_a": relative(ga, ref_ga), "grad_b": relative(gb, ref_gb),
            "psi_dtype": str(psi.dtype).replace("torch.", ""),
            "grad_dtype": str(ga.dtype).replace("torch.", "")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", nargs="+", default=None, choices=sorted(DTYPES),
                        help="default: fp32 and bf16 on CPU; fp32, bf16 and fp16 on CUDA")
    parser.add_argument("--shape", type=int, nargs=3, default=None, metavar=("S", "B", "H"),
                        help=f"[s, b, h] (default {SHAPE['cpu']} on CPU, {SHAPE['cuda']} on CUDA)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kernel_accuracy: --device cuda but no CUDA device is visible")
    if not fused_available(device):
        raise SystemExit(f"kernel_accuracy: the fused kernel is not built for {device.type}; "
                         "reinstall with `pip install --no-build-isolation --no-deps -e .`")
    dtypes = args.dtype or (["fp32", "bf16"] if device.type == "cpu" else ["fp32", "bf16", "fp16"])
    shape = tuple(args.shape or SHAPE[device.type])
    if min(shape) < 1 or shape[2] < 2:
        raise SystemExit(f"kernel_accuracy: --shape {' '.join(map(str, shape))}: "
                         "need S, B >= 1 and H >= 2 (one hidden unit has no direction to compare)")
    print(f"fused token_displacement vs the float64 reference, [s, b, h] = {list(shape)} "
          f"on {device.type}")
    print(f"  {'dtype':5s} {'psi max |err|':>14s} {'grad a max err':>15s} "
          f"{'grad b max err':>15s}   (gradients: relative to the largest |reference| gradient)")
    result, failed = {"device": device.type, "shape": list(shape), "errors": {}, "limits": {}}, []
    for name in dtypes:
        e = errors(shape, DTYPES[name], device)
        psi_limit, grad_limit = LIMITS[name]
        checked = (("psi", psi_limit), ("grad_a", grad_limit), ("grad_b", grad_limit))
        bad = [k for k, limit in checked if not math.isfinite(e[k]) or e[k] > limit]
        failed += [f"{name} {k} {e[k]:.3g} > {psi_limit if k == 'psi' else grad_limit:g}"
                   for k in bad]
        print(f"  {name:5s} {e['psi']:14.3e} {e['grad_a']:15.3e} {e['grad_b']:15.3e}   "
              f"limits {psi_limit:g} / {grad_limit:g}: {'ok' if not bad else 'OVER'}")
        result["errors"][name] = {k: e[k] for k in ("psi", "grad_a", "grad_b")}
        result["limits"][name] = {"psi": psi_limit, "grad": grad_limit}
    result["ok"] = not failed
    if failed:
        print("kernel_accuracy: over the limit: " + "; ".join(failed))
    # a non-finite error is written as a string ("nan"), never as a bare NaN number
    for errs in result["errors"].values():
        for k, v in errs.items():
            errs[k] = v if math.isfinite(v) else str(v)
    print("RESULT " + json.dumps(result, allow_nan=False), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
