"""Context parallelism's effect on one long sequence: step time and memory per rank at CP1
and CP2, side by side in one run, and CP2's loss and Psi checked against CP1's.

    python bench/context_parallel_step.py                        # CPU, gloo, fp32
    python bench/context_parallel_step.py --device cuda --seq 16384 --hidden 2048

Each layout is its own launch of this script: CP1 one process (a world of one), CP2 two
under ``torch.distributed.run`` (gloo on CPU, NCCL on CUDA). A launch builds the same JREG model the
trainer builds (megatron-core GPTModel with JREG layers, DDP, AdamW, seed 1234) and runs
training steps (forward, backward with the JREG penalty, optimizer) on one micro-batch of
random tokens: the whole sequence on CP1, its two chunks of four on each CP2 rank.

Time: ``--warmup`` untimed steps, then the median of ``--steps`` timed ones; a CP2 step
takes as long as its slower rank. On CPU each rank runs ``--threads`` threads (default 1:
CP2 uses two cores where CP1 uses one, as it uses two GPUs where CP1 uses one).

Memory per rank: "saved" is the bytes of the distinct storages autograd keeps for
backward in the first step, parameters left out (the activations, which CP splits over its
ranks; the keys and values it all-gathers are among them), exact on any device. "peak"
is, on CUDA, ``torch.cuda.max_memory_allocated`` over the timed steps; on CPU the
process's resident set high-water mark over them (reset through /proc/self/clear_refs),
which includes the interpreter, the libraries and the weights. "growth" is that peak less
the memory held just before the timed steps.

Check: CP2's LM loss and per-layer Psi of the first step (same weights, same batch) equal
CP1's within a relative 1e-5 in fp32 (2e-2 in bf16); otherwise the run exits 1.
With one GPU only CP1 runs: CP2 is reported as skipped, with the reason. Prints a table,
a summary line and a ``RESULT {json}`` line (read by bench/gpu_checks.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # the package of this checkout
sys.path.insert(0, HERE)  # one_device_model

TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}  # relative, CP2's loss and Psi against CP1's
MIB, GIB = 2**20, 2**30


# ---- one launch (a rank of CP1 or CP2) ------------------------------------------------------
def finite(value):
    """``value``, or None where it is not a finite number (JSON has no NaN)."""
    return value if value is not None and math.isfinite(value) else None


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _saved_activation_bytes(step, chunks):
    """(step's result, bytes of the distinct storages autograd saves for backward in it,
    the parameters' own storages left out)."""
    import torch

    params = {p.untyped_storage().data_ptr() for chunk in chunks for p in chunk.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = step()
    return result, sum(storages.values())


def worker(args) -> None:
    """One rank of a CP ``args.cp`` launch; rank 0 writes every rank's figures to
    ``args.worker_out``. A model the flags cannot make: one line, exit 2."""
    from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig, core_attention
    from megatron_jreg.errors import UserError

    try:
        model_cfg = model_config(args, ModelConfig)
    except UserError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"context_parallel_step: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    import one_device_model

    device = one_device_model.start(args.device)
    import torch
    import torch.distributed as dist

    from megatron_jreg.config.run import OptimConfig
    from megatron_jreg.model.jreg_layer import JregTracker
    from megatron_jreg.training.optimizer import build_optimizer
    from megatron_jreg.training.step import forward_backward

    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    rank, tag = dist.get_rank(), f"[CP{args.cp}]"

    def say(text):
        if rank == 0:
            print(f"{tag} {text}", flush=True)

    tracker = JregTracker(JregConfig(lam=args.jreg_lambda, alpha=1.0), args.layers)
    t0 = time.perf_counter()
    config, chunks = one_device_model.build(model_cfg,
                                            ParallelConfig(context_parallel_size=args.cp),
                                            tracker, device, float16_module=model_cfg.bf16)
    optimizer = build_optimizer(chunks, config, model_cfg, OptimConfig(lr=1e-4, clip_grad=1.0))
    config.grad_scale_func = optimizer.scale_loss
    batch = one_device_model.random_batch(args.vocab, args.micro_batch, args.seq, device)
    say(f"built in {time.perf_counter() - t0:.1f} s on {dist.get_world_size()} rank(s), attention "
        f"{core_attention(model_cfg)[0]}; each rank holds {args.seq // args.cp} of {args.seq} "
        "tokens")

    def step():
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(chunks, [batch], args.seq, args.micro_batch, tracker)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        return out

    t0 = time.perf_counter()
    first, saved = _saved_activation_bytes(step, chunks)  # the first step: the weights as built
    say("step 1 (warm-up; the checked loss and Psi, the saved activations) "
        f"{time.perf_counter() - t0:.2f} s")
    for i in range(1, args.warmup):
        t0 = time.perf_counter()
        step()
        say(f"step {i + 1} (warm-up) {time.perf_counter() - t0:.2f} s")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the resident set's high-water mark starts again from the current one
        before = _status_bytes("VmRSS")
    times = []
    for i in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        say(f"step {args.warmup + i + 1} (timed) {times[-1]:.2f} s")
    peak = torch.cuda.max_memory_allocated() if cuda else _status_bytes("VmHWM")
    mine = {"times": times, "saved_bytes": saved, "peak_bytes": peak, "growth_bytes": peak - before}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        # a step lasts as long as its slowest rank; memory per rank: the largest rank's
        step_s = statistics.median(max(r["times"][i] for r in ranks) for i in range(args.steps))
        result = {
            "cp": args.cp, "ranks": len(ranks), "attention": core_attention(model_cfg)[0],
            "step_s": step_s, "tokens_per_s": args.micro_batch * args.seq / step_s,
            "saved_bytes_per_rank": max(r["saved_bytes"] for r in ranks),
            "peak_bytes_per_rank": max(r["peak_bytes"] for r in ranks),
            "growth_bytes_per_rank": max(r["growth_bytes"] for r in ranks),
            "lm_loss": finite(first["lm_loss"]), "psi": [finite(p) for p in first["psi"]],
        }
        with open(args.worker_out, "w") as f:
            json.dump(result, f)


# ---- the run: both launches, the table, the check -------------------------------------------
def model_config(args, model_class):
    return model_class(num_layers=args.layers, hidden_size=args.hidden,
                       num_attention_heads=args.hidden // 64, seq_length=args.seq,
                       vocab_size=args.vocab, bf16=args.dtype == "bf16")


def launch(args, cp: int) -> dict:
    """One CP ``cp`` launch under torch.distributed.run; its rank 0's figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # CP1: a plain process (a world of one); CP2: one process per rank under torchrun
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cp)]
        cmd = ([sys.executable] + (launcher if cp > 1 else [])
               + [os.path.abspath(__file__), "--worker-out", out, "--cp", str(cp)])
        for flag in ("device", "dtype", "layers", "hidden", "seq", "micro_batch", "vocab",
                     "jreg_lambda", "warmup", "steps", "threads"):
            cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(args.threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        if args.device == "cpu":
            env["MEGATRON_JREG_DEVICE"] = "cpu"
        print(f"==> CP{cp}: {cp} process(es), {args.seq} tokens split over {cp}", flush=True)
        code = subprocess.call(cmd, cwd=REPO, env=env)
        if code == 2 and cp == 1:  # the flags make no model: its one line is above
            raise SystemExit(2)
        if code != 0 or not os.path.exists(out):
            raise SystemExit(f"context_parallel_step: the CP{cp} launch failed (exit {code}); its "
                             "output is above")
        with open(out) as f:
            return json.load(f)


def ratio(a, b):
    return b / a if a and b is not None and math.isfinite(b / a) else None


def rel_diff(ref: dict, other: dict):
    """The largest relative difference of the LM loss and each Psi_l (None if one is not a
    finite number)."""
    pairs = [(ref["lm_loss"], other["lm_loss"])] + list(zip(ref["psi"], other["psi"]))
    if any(x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) for x, y in pairs):
        return None
    return max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)


def fmt_bytes(n, unit):
    if n is None:
        return "n/a"
    return f"{n / (GIB if unit == 'GiB' else MIB):,.{3 if unit == 'GiB' else 1}f} {unit}"


def fmt_ratio(r):
    return "n/a" if r is None else f"{r:.2f}x"


def report(args, cp1: dict, cp2, skipped) -> dict:
    cuda = args.device == "cuda"
    unit = "GiB" if cuda else "MiB"
    peak_name = "peak allocated" if cuda else "peak RSS"
    rows = [("step time", lambda r: f"{r['step_s']:.3f} s", "step_s"),
            ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}", "tokens_per_s"),
            ("saved activations/rank", lambda r: fmt_bytes(r["saved_bytes_per_rank"], unit),
             "saved_bytes_per_rank"),
            (f"{peak_name}/rank", lambda r: fmt_bytes(r["peak_bytes_per_rank"], unit),
             "peak_bytes_per_rank"),
            (f"{peak_name} growth/rank", lambda r: fmt_bytes(r["growth_bytes_per_rank"], unit),
             "growth_bytes_per_rank")]
    ratios = {key: ratio(cp1[key], cp2[key]) if cp2 else None for _, _, key in rows}
    print(f"\n{'':24s} | {'CP1':>14s} | {'CP2':>14s} | CP2/CP1")
    print(f"{'-' * 24}-|-{'-' * 14}-|-{'-' * 14}-|--------")
    for name, show, key in rows:
        print(f"{name:24s} | {show(cp1):>14s} | {show(cp2) if cp2 else 'skipped':>14s} | "
              f"{fmt_ratio(ratios[key]) if cp2 else '-'}")
    check = None
    if cp2:
        diff, limit = rel_diff(cp1, cp2), TOLERANCE[args.dtype]
        check = {"max_rel_diff": diff, "limit": limit, "ok": diff is not None and diff <= limit}
        shown = "not a finite number" if diff is None else f"{diff:.1e}"
        print(f"\ncheck: CP2's lm loss and Psi of the first step (same weights and batch) against "
              f"CP1's: max rel diff {shown} (limit {limit:.0e}): "
              f"{'ok' if check['ok'] else 'FAILED'}")
        summary = (f"CP2/CP1 step time {fmt_ratio(ratios['step_s'])}, saved activations per rank "
                   f"{fmt_ratio(ratios['saved_bytes_per_rank'])}, {peak_name} per rank "
                   f"{fmt_ratio(ratios['peak_bytes_per_rank'])} (growth "
                   f"{fmt_ratio(ratios['growth_bytes_per_rank'])}); loss and Psi "
                   + ("equal" if check["ok"] else "DIFFER") + f" (rel {shown})")
    else:
        summary = (f"CP1 step {cp1['step_s']:.3f} s, {peak_name} per rank "
                   f"{fmt_bytes(cp1['peak_bytes_per_rank'], unit)}; CP2 skipped: {skipped}")
    print(f"summary: {summary}")
    return {"device": args.device, "dtype": args.dtype, "layers": args.layers,
            "hidden": args.hidden,
            "seq": args.seq, "micro_batch": args.micro_batch, "vocab": args.vocab,
            "jreg_lambda": args.jreg_lambda, "threads_per_rank": None if cuda else args.threads,
            "steps": args.steps,
            "peak_memory": "cuda max_memory_allocated" if cuda else "cpu peak RSS",
            "cp1": cp1, "cp2": cp2, "cp2_skipped": skipped, "ratios": ratios, "check": check}


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"context_parallel_step: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse(argv=None):
    parser = OneLineParser(description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="auto: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256,
                        help="hidden size, a multiple of 64 (heads of 64)")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length, a multiple of 4")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--jreg-lambda", type=float, default=1.0,
                        help="JREG's lambda (> 0: the penalty trains)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed steps, at least 1 (the checked one)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    parser.add_argument("--cp", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for flag in ("layers", "hidden", "seq", "micro_batch", "vocab", "warmup", "steps", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if args.hidden % 64:
        parser.error(f"--hidden {args.hidden}: must be a multiple of 64 (heads of 64 dimensions)")
    if args.seq % 4:
        parser.error(f"--seq {args.seq}: must be a multiple of 4 (CP2 cuts a sequence into 4 equal "
                     f"chunks); try --seq {args.seq + 4 - args.seq % 4}")
    if not (math.isfinite(args.jreg_lambda) and args.jreg_lambda > 0):
        parser.error(f"--jreg-lambda {args.jreg_lambda}: must be > 0 (the penalty's gradient is "
                     "part of what is measured)")
    if args.dtype == "auto":
        args.dtype = "bf16" if args.device == "cuda" else "fp32"
    return parser, args


def main(argv=None) -> int:
    parser, args = parse(argv)
    if args.worker_out:
        worker(args)
        return 0
    skipped = None
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if gpus == 0:
            parser.error("--device cuda: no GPU is visible here; run with --device cpu")
        if gpus < 2:
            skipped = f"{gpus} GPU here, CP2 needs 2"
    print(f"context parallelism on {args.device} ({'NCCL' if args.device == 'cuda' else 'gloo'}), "
          f"{args.dtype}: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, vocab {args.vocab}, JREG lambda {args.jreg_lambda}, "
          f"{args.warmup} warm-up + {args.steps} timed steps"
          + ("" if args.device == "cuda" else f", {args.threads} thread(s) per rank"), flush=True)
    cp1 = launch(args, 1)
    cp2 = None if skipped else launch(args, 2)
    result = report(args, cp1, cp2, skipped)
    print("RESULT " + json.dumps(result), flush=True)
    return 1 if cp2 and not result["check"]["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
