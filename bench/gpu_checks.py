"""The prepared GPU checks, one run, one summary table (bash bench/gpu_checks.sh calls this).

Each check runs as its own process with a time limit; a failure is recorded and the rest
still run. The table at the end has one row per check: status, the key figure, seconds.

Checks: the GPU-marked tests; the fused op's bandwidth against the GPU's peak; JREG's step
overhead at the 170m preset's dimensions; the 3B script's model flags (bf16, selective
recompute of layernorm) at 2 layers with the local spec and, when installed, Transformer
Engine; tokens/s, TFLOP/s and MFU of 170m and 1b training steps (seq 2048, bf16) per core
attention (megatron-core's unfused, PyTorch SDPA, Transformer Engine when installed) with
JREG off and on, and JREG's overhead from the SDPA pairs. ``--device cpu --quick`` runs the same
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
        sizes = {"170m": ["--preset", "tiny", "--seq", "64", "--micro-batch", "2"],
                 "1b": ["--preset", "tiny", "--seq", "64", "--micro-batch", "2"]}
        toy = ["--vocab", "512", "--warmup", "1", "--timed-steps", "2"]
        sizes = {k: v + toy for k, v in sizes.items()}
        three_b = ["--preset", "tiny", "--layers", "2", "--seq", "64", "--micro-batch", "1"] + toy
        op = ["--shape", "64", "2", "128", "--iters", "2"]
        overhead = ["--layers", "2", "--hidden", "128", "--seq", "64", "--micro-batch", "2",
                    "--vocab", "512", "--timed-steps", "2"]
    else:
        # seq 2048 (the presets'), bf16, micro-batch 8: fits with every attention on a
        # 80 GB GPU at 1b (megatron's unfused attention keeps the s x s scores)
        sizes = {"170m": ["--preset", "170m", "--micro-batch", "8"],
                 "1b": ["--preset", "1b", "--micro-batch", "8"]}
        three_b = ["--preset", "3b", "--layers", "2", "--micro-batch", "2"]
        op = ["--dtype", "bf16"]
        overhead = ["--layers", "12", "--hidden", "768", "--seq", "2048", "--micro-batch", "8",
                    "--vocab", "32000"]
    step = [py, "bench/gpu_model_step.py", "--device", device]
    layernorm = ["--recompute-modules", "layernorm"]
    if cuda:
        # -o addopts=: one process (pytest.ini asks for pytest-xdist workers, which the GPU
        # machine may not have)
        yield "gpu tests", [py, "-m", "pytest", "-q", "-o", "addopts=", "-m", "gpu", "tests/ops"], 300
    yield "op bandwidth", [py, "bench/displacement_op.py", "--device", device] + op, 180
    yield "JREG step overhead", [py, "bench/jreg_overhead.py", "--device", device] + overhead, 300
    yield "3b flags x2, local", step + three_b + ["--transformer-impl", "local"] + layernorm, 240
    yield "3b flags x2, TE", step + three_b + ["--transformer-impl", "transformer_engine"] + layernorm, 240
    # tokens/s and MFU per attention (megatron's unfused, PyTorch SDPA, Transformer Engine),
    # JREG off (lambda 0 still measures) and on; SDPA's off/on pair gives JREG's overhead
    for preset, attentions in (("170m", ("sdpa",)), ("1b", ("unfused", "sdpa", "TE"))):
        for attention in attentions:
            impl = ["--transformer-impl", "transformer_engine" if attention == "TE" else "local"]
            backend = ["--attention-backend", "auto" if attention == "TE" else attention]
            for lam in ("0", "1"):
                name = f"{preset} {attention}, JREG {'on' if lam == '1' else 'off'}"
                yield name, step + sizes[preset] + impl + backend + ["--jreg-lambda", lam], 240


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
    if r.get("attention"):
        text += f", attention {r['attention']}"
    if r.get("mfu") is not None:
        text += f", MFU {100 * r['mfu']:.1f}%"
    if r.get("peak_mem_gib") is not None:
        text += f", {r['peak_mem_gib']:.1f} GiB"
    ok = r.get("lm_loss") is not None and r.get("psi_finite")
    return text + ("" if ok else ", NON-FINITE loss/psi")


def overhead_rows(rows):
    """JREG on / off step time for each model-step pair that ran: the overhead at that size."""
    out = []
    results = {name: figure for name, status, figure, _ in rows if status == "ok"}
    for name, figure in results.items():
        if not name.endswith("JREG on"):
            continue
        off = results.get(name[:-len("on")] + "off")
        tok_on = re.match(r"([\d,]+) tok/s", figure)
        tok_off = re.match(r"([\d,]+) tok/s", off or "")
        if tok_on and tok_off:
            ratio = float(tok_off.group(1).replace(",", "")) / float(tok_on.group(1).replace(",", ""))
            out.append((name[:-len(", JREG on")] + ": JREG on/off step time", "ok",
                        f"{ratio:.3f}x", 0.0))
    return out


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
        if (name.endswith(", TE") or " TE," in name) and not te:
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
    rows += overhead_rows(rows)
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
