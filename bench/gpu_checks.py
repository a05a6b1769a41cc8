"""The prepared GPU checks, one run, one summary table (bash bench/gpu_checks.sh calls this).

Each check runs as its own process with a time limit; a failure is recorded and the rest
still run. The table at the end has one row per check: status, the key figure, seconds.

Checks: the GPU-marked tests; the fused op's bandwidth against the GPU's peak; JREG's step
overhead at the 170m preset's dimensions; the 3B script's model flags (bf16, selective
recompute of layernorm) at 2 layers with the local spec and, when installed, Transformer
Engine; tokens/s and MFU of a 170m training step. ``--device cpu --quick`` runs the same
sequence at toy sizes (a smoke test of this script; no GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checks(device: str, quick: bool):
    py = sys.executable
    cuda = device == "cuda"
    if quick:
        model = ["--preset", "tiny", "--seq", "64", "--micro-batch", "2", "--vocab", "512",
                 "--warmup", "1", "--timed-steps", "2"]
        three_b = ["--preset", "tiny", "--layers", "2", "--seq", "64", "--micro-batch", "1",
                   "--vocab", "512", "--warmup", "1", "--timed-steps", "2"]
        op = ["--shape", "64", "2", "128", "--iters", "2"]
        overhead = ["--layers", "2", "--hidden", "128", "--seq", "64", "--micro-batch", "2",
                    "--vocab", "512", "--timed-steps", "2"]
    else:
        model = ["--preset", "170m", "--micro-batch", "8"]
        three_b = ["--preset", "3b", "--layers", "2", "--micro-batch", "2"]
        op = ["--dtype", "bf16"]
        overhead = ["--layers", "12", "--hidden", "768", "--seq", "2048", "--micro-batch", "8",
                    "--vocab", "32000"]
    step = [py, "bench/gpu_model_step.py", "--device", device]
    layernorm = ["--recompute-modules", "layernorm"]
    if cuda:
        yield "gpu tests", [py, "-m", "pytest", "-q", "-m", "gpu", "tests/ops"], 300
    yield "op bandwidth", [py, "bench/displacement_op.py", "--device", device] + op, 180
    yield "JREG step overhead", [py, "bench/jreg_overhead.py", "--device", device] + overhead, 300
    yield "3b flags x2, local", step + three_b + ["--transformer-impl", "local"] + layernorm, 240
    yield "3b flags x2, TE", step + three_b + ["--transformer-impl", "transformer_engine"] + layernorm, 240
    yield "170m tokens/s, MFU", step + model, 240


def key_figure(name: str, output: str) -> str:
    """The figure a reader wants from a check's output."""
    if name == "gpu tests":
        m = re.search(r"(\d+ passed[^\n]*)", output)
        return m.group(1) if m else ""
    if name == "op bandwidth":
        found = re.findall(r"fused (forward|backward)\s+([\d.]+) GB/s(?: = ([\d.]+)% of peak)?", output)
        if found:
            return ", ".join(f"{p} {g} GB/s" + (f" ({pc}% of peak)" if pc else "") for p, g, pc in found)
        m = re.search(r"ratio fused/reference: [^\n]*", output)
        return m.group(0) if m else ""
    if name == "JREG step overhead":
        found = re.findall(r"JREG (\w+)\s+step time\s+([\d.]+) s \(\s*([\d.]+)x off\)", output)
        return ", ".join(f"{v} {x}x" for v, _, x in found if v != "off")
    m = re.search(r"^RESULT (.*)$", output, re.M)
    if not m:
        return ""
    r = json.loads(m.group(1))
    text = f"{r['tokens_per_s']:,.0f} tok/s, {r['tflops']:.1f} TFLOP/s"
    if r.get("mfu") is not None:
        text += f", MFU {100 * r['mfu']:.1f}%"
    if r.get("peak_mem_gib") is not None:
        text += f", {r['peak_mem_gib']:.1f} GiB"
    ok = r.get("lm_loss") is not None and r.get("psi_finite")
    return text + ("" if ok else ", NON-FINITE loss/psi")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="toy sizes (a smoke test of this script)")
    args = parser.parse_args()
    from megatron_jreg.model.config import transformer_engine_available

    te = transformer_engine_available()
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    rows, failed = [], 0
    for name, cmd, limit in checks(args.device, args.quick):
        if name.endswith(", TE") and not te:
            rows.append((name, "skipped", "Transformer Engine not installed", 0.0))
            continue
        print(f"==> {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            output, code = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), "timeout"
        seconds = time.time() - t0
        print(output[-4000:], flush=True)
        status = "ok" if code == 0 else f"FAIL ({code})"
        failed += code != 0
        rows.append((name, status, key_figure(name, output) if code == 0 else output.strip().splitlines()[-1:][0][:120] if output.strip() else "", seconds))
    width = max(len(r[0]) for r in rows)
    print(f"\nsummary ({args.device}{', quick' if args.quick else ''}; Transformer Engine "
          f"{'installed' if te else 'not installed'})")
    print(f"| {'check':{width}s} | status   | figure | s |")
    print(f"|{'-' * (width + 2)}|----------|--------|---|")
    for name, status, figure, seconds in rows:
        print(f"| {name:{width}s} | {status:8s} | {figure} | {seconds:.0f} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
