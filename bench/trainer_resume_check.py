"""The trainer end to end on one device: an uninterrupted run that saves a checkpoint half
way, a second run resumed from that checkpoint, and the largest difference of their losses.

Both are ``python -m megatron_jreg.train`` at the tiny preset (seq 64, micro-batch 4,
global batch 8) with the distributed optimizer, on a small byte-level indexed dataset
built in a temporary directory (tools/make_demo_corpus.py, tools/preprocess_data.py
--tokenizer-type ByteTokenizer). On CUDA: NCCL, --bf16, --jreg-impl fused; on CPU: gloo,
fp32, --jreg-impl auto. Run 1 trains --train-iters steps and saves every half of them;
run 2 loads run 1's checkpoint of the middle step (--ckpt-step) and trains the rest. Both
write their losses with --metrics-file; each resumed step's lm loss is compared with the
uninterrupted run's.

With ``--save-device cpu --device cuda`` run 1 trains and saves on the CPU and run 2
resumes that checkpoint on the GPU, both in fp32: the CUDA generator and the dropout streams
of a CPU save are the CUDA form of its seeds (checkpoint/rng_state.py), which a GPU run sets
with ``torch.cuda.set_rng_state`` as Megatron-LM does; run 2 must say so in one line and
draw its dropout from them (``--dropout``). The GPU draws other dropout masks than the CPU,
so the losses are compared within 5% (``--rtol``).

Pass: bit-exact on CPU (fp32: the same operations in the same order), within --rtol
(default 1e-3 relative) on CUDA. The last line is ``RESULT {json}`` with
``max_abs_diff`` and ``max_rel_diff`` (read by bench/gpu_checks.py).

    python bench/trainer_resume_check.py --device cpu
    python bench/trainer_resume_check.py --device cpu --dropout 0.1
    python bench/trainer_resume_check.py --device cuda
    python bench/trainer_resume_check.py --device cuda --save-device cpu --dropout 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from gpu_checks import die_with_parent  # noqa: E402  (bench/, this script's folder)


def env_for(device: str) -> dict:
    """The children's environment: this checkout's package, a world of one."""
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if device == "cpu":
        env["MEGATRON_JREG_DEVICE"] = "cpu"
    else:
        env.pop("MEGATRON_JREG_DEVICE", None)
    return env


def run(cmd, env, what: str) -> str:
    """Runs ``cmd`` in the checkout (same process group: a timeout of the caller ends it too)."""
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          preexec_fn=die_with_parent)
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n{output[-4000:]}")
    return output


def build_data(directory: str, env) -> str:
    """A byte-level indexed dataset of the demo corpus (~0.1 MB); returns its prefix."""
    corpus = os.path.join(directory, "corpus.jsonl")
    prefix = os.path.join(directory, "demo")
    run([sys.executable, "tools/make_demo_corpus.py", "--output", corpus, "--max-mb", "0.1"], env,
        "make_demo_corpus")
    run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", prefix,
         "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"], env,
        "preprocess_data")
    return prefix + "_text_document"


def trainer_flags(device: str, data: str, iters: int, dropout: float = 0.0,
                  precision: str = "") -> list:
    flags = ["--model-preset", "tiny", "--seq-length", "64", "--data-path", data,
             "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout),
             "--tokenizer-type", "ByteTokenizer", "--micro-batch-size", "4",
             "--global-batch-size", "8", "--train-iters", str(iters), "--log-interval", "1",
             "--eval-interval", "0", "--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", "1234",
             "--jreg-lambda", "1.0", "--jreg-alpha", "1.0", "--use-distributed-optimizer"]
    if device == "cuda":
        return flags + (["--bf16"] if precision == "bf16" else []) + ["--jreg-impl", "fused"]
    return flags + ["--jreg-impl", "auto"]


def losses(path: str) -> dict:
    """{iteration: lm loss} of a metrics file (megatron_jreg/training/metrics.py's JSONL)."""
    out = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if "lm_loss" in record:
                out[record["iteration"]] = record["lm_loss"]
    return out


def compare(full: dict, resumed: dict, start: int, iters: int) -> dict:
    """The resumed steps against the same steps of the uninterrupted run."""
    expected = list(range(start + 1, iters + 1))
    if sorted(resumed) != expected:  # a run that restarted from step 1 would match exactly
        raise SystemExit(f"the resumed run logged iterations {sorted(resumed)}, "
                         f"expected {expected}: "
                         f"it did not resume from the checkpoint of step {start}")
    rows = []
    for it in expected:
        a, b = full[it], resumed[it]
        if a is None or b is None:
            raise SystemExit(f"iteration {it}: a non-finite lm loss (uninterrupted {a}, "
                             f"resumed {b})")
        rows.append((it, a, b, abs(a - b), abs(a - b) / abs(a)))
    return {"rows": rows, "max_abs_diff": max(r[3] for r in rows),
            "max_rel_diff": max(r[4] for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--train-iters", type=int, default=8,
                        help="steps of the uninterrupted run (even)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="largest relative lm-loss difference that passes (default 0 on CPU, "
                             "1e-3 on CUDA)")
    parser.add_argument("--keep", default=None,
                        help="work in this directory and keep it (default: a temporary one)")
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="hidden and attention dropout of both runs (default 0, "
                             "the tiny preset's)")
    parser.add_argument("--save-device", default=None, choices=["cpu", "cuda"],
                        help="the device of the uninterrupted run that saves (default --device); "
                             "cpu with --device cuda: a GPU resume of a CPU save, both fp32")
    args = parser.parse_args()
    if args.train_iters < 2 or args.train_iters % 2:
        parser.error(f"--train-iters {args.train_iters}: need an even number >= 2")
    if not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout}: need 0 <= p < 1")
    save_device = args.save_device or args.device
    across = save_device != args.device
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("trainer_resume_check: --device cuda but no CUDA device is visible "
                             "(a CUDA build of torch and a GPU; or --device cpu)")
    precision = "fp32" if args.device == "cpu" or across else "bf16"
    rtol = (args.rtol if args.rtol is not None else 0.05 if across and args.dropout
            else 0.0 if args.device == "cpu" else 1e-3)
    env, save_env = env_for(args.device), env_for(save_device)
    with tempfile.TemporaryDirectory(prefix="trainer_resume_") as tmp:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        data = build_data(work, env)
        half = args.train_iters // 2
        train = [sys.executable, "-m", "megatron_jreg.train"] + trainer_flags(
            args.device, data, args.train_iters, args.dropout, precision)
        train_first = [sys.executable, "-m", "megatron_jreg.train"] + trainer_flags(
            save_device, data, args.train_iters, args.dropout, precision)
        full_metrics, resumed_metrics = (os.path.join(work, n)
                                         for n in ("full.jsonl", "resumed.jsonl"))
        for path in (full_metrics, resumed_metrics):  # the sink appends
            if os.path.exists(path):
                os.remove(path)
        saved = os.path.join(work, "ckpt_full")
        out = run(train_first + ["--save", saved, "--save-interval", str(half),
                                 "--metrics-file", full_metrics], save_env, "the uninterrupted run")
        print(f"uninterrupted run ({save_device}): " + out.strip().splitlines()[-1])
        out = run(train
                  + ["--load", saved, "--ckpt-step", str(half), "--save",
                     os.path.join(work, "ckpt_resumed"),
                     "--save-interval", str(half), "--metrics-file", resumed_metrics],
                  env, "the resumed run")
        print(f"resumed run ({args.device}):       " + out.strip().splitlines()[-1])
        streams = [line for line in out.splitlines() if "model-parallel random streams" in line]
        for line in streams:
            print("resumed run: " + line.strip())
        if across and not any("start from the saved seeds" in line for line in streams):
            raise SystemExit(f"the resumed run on {args.device} did not set the CUDA form of the "
                             f"{save_device} save's seeds:\n{out[-3000:]}")
        result = compare(losses(full_metrics), losses(resumed_metrics), half, args.train_iters)
    print(f"lm loss per step, resumed from the checkpoint of step {half} vs uninterrupted "
          f"(saved on {save_device}, resumed on {args.device}, {precision}, "
          f"dropout {args.dropout:g}):")
    print(f"  {'step':>4s} {'uninterrupted':>15s} {'resumed':>15s} {'|diff|':>10s} {'rel':>10s}")
    for it, a, b, diff, rel in result["rows"]:
        print(f"  {it:4d} {a:15.8f} {b:15.8f} {diff:10.3e} {rel:10.3e}")
    ok = result["max_rel_diff"] <= rtol
    print(f"largest |diff| {result['max_abs_diff']:.3e} (relative {result['max_rel_diff']:.3e}); "
          f"tolerance {rtol:g} relative{' (bit-exact)' if rtol == 0 else ''}: "
          f"{'ok' if ok else 'OVER'}")
    print("RESULT " + json.dumps({
        "device": args.device, "save_device": save_device, "dropout": args.dropout,
        "precision": precision, "resumed_from": half,
        "steps_compared": [r[0] for r in result["rows"]], "max_abs_diff": result["max_abs_diff"],
        "max_rel_diff": result["max_rel_diff"], "rtol": rtol, "ok": ok}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
