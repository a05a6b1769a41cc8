"""How a start from a checkpoint reads the source checkpoint, and how long it takes to the
first training step: which files of the checkpoint are opened, how often, and from where.

Builds the byte-level demo data (tools/make_demo_corpus.py --max-mb 0.1,
tools/preprocess_data.py --tokenizer-type ByteTokenizer) and trains a tiny run
(``python -m megatron_jreg.train --model-preset tiny``, seq 64, micro-batch 4, global
batch 8, eval off, CPU; --lr-decay-iters 6, the schedule the resume needs) for 4 steps,
saving iteration 4. Then two starts:

  resume      --model-preset tiny --load CKPT --save CKPT --train-iters 6 (steps 5, 6)
  pretrained  --pretrained-checkpoint CKPT --use-checkpoint-args --save OTHER --train-iters 2
              (no --model-preset; the same data and tokenizer flags)

Each launch is a fresh interpreter that installs a ``sys.addaudithook`` hook (event "open":
builtins.open, io.open, os.open; opens from C/C++ code, e.g. torch's mmap loads, and
os.open's relative to a dir_fd are not seen) before it runs megatron_jreg.train with
runpy; the hook logs each open of a path under the source checkpoint (a fresh copy of it
for every launch: a resume writes into it), with a monotonic timestamp and its stack. This
script reads the trainer's output line by line and takes the time it reads the first step
line (``iteration   N/M | ...``): the opens logged before it count (those in the few
microseconds between the write and the read would too), and launch to that line is the
time to the first step. One warm-up launch per start, then --repeats timed ones (median);
the opens are those of the first timed launch (a line says so if another launch differs).
"other": files under the checkpoint directory outside iter_0000004/ but the tracker, e.g.
the writer lock. "s first open to step": from the first logged open of the checkpoint to
the first step line (median). After the table, per file, the distinct call sites: the
innermost megatron_jreg frames (and the first outside megatron_jreg/checkpoint/), the
library function they called, the frame that opened (the manifest's checksums are read in
a thread pool: their stacks end there).

    python bench/checkpoint_startup.py --repeats 1     # ~30 s on 2 CPU cores

(the default, 3 timed launches per start: ~1-2 min). ``--repo DIR`` runs the trainer of
another checkout (e.g. a worktree of an earlier commit, with its directory on PYTHONPATH)
for a side-by-side count.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

STEP = re.compile(r"^iteration\s+\d+/\d+ \|")
TRACKER = "latest_checkpointed_iteration.txt"
COLUMNS = ("common.pt", ".metadata", "metadata.json", "*.distcp", "run_config.yaml",
           "jreg_manifest.json", "jreg_complete.json", TRACKER)
HOOK = r"""
import importlib.util, json, os, sys, threading, time
log, watch = open(sys.argv[1], "w", buffering=1), os.path.abspath(sys.argv[2]) + os.sep
log.write(json.dumps({"package": importlib.util.find_spec("megatron_jreg").origin}) + "\n")
lock = threading.Lock()
def hook(event, args):
    if event != "open" or not args or isinstance(args[0], int):
        return
    path = os.path.abspath(os.fsdecode(os.fspath(args[0])))
    if not path.startswith(watch):
        return
    flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
    frames, f = [], sys._getframe(1)
    while f is not None:
        frames.append(f"{f.f_code.co_filename}:{f.f_code.co_name}:{f.f_lineno}")
        f = f.f_back
    rec = {"t": time.monotonic(), "path": path, "write": bool(flags & (os.O_WRONLY | os.O_RDWR)),
           "stack": frames}
    with lock:
        log.write(json.dumps(rec) + "\n")
sys.addaudithook(hook)
sys.argv = ["megatron_jreg.train"] + sys.argv[3:]
import runpy
runpy.run_module("megatron_jreg.train", run_name="__main__", alter_sys=True)
"""


def default_repo() -> str:
    here = os.getcwd()
    if os.path.isfile(os.path.join(here, "tools", "make_demo_corpus.py")):
        return here
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, repo, env, what):
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed ({proc.returncode}): {' '.join(cmd)}\n"
                         f"{(proc.stdout + proc.stderr)[-4000:]}")
    return proc.stdout + proc.stderr


def launch(argv, watch, log, repo, env):
    """One hooked trainer run: (seconds to the first step line, its monotonic time, the opens
    before it, the child's megatron_jreg)."""
    cmd = [sys.executable, "-c", HOOK, log, watch] + argv
    t0, first, out = time.monotonic(), None, []
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        for line in proc.stdout:
            if first is None and STEP.match(line):
                first = time.monotonic()
            out.append(line)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"trainer failed ({proc.returncode}, first step line "
                         f"{'seen' if first else 'not seen'}): "
                         f"{' '.join(argv)}\n{''.join(out)[-4000:]}")
    with open(log) as f:
        records = [json.loads(line) for line in f]
    return first - t0, first, [r for r in records[1:] if r["t"] <= first], records[0]["package"]


def column(path, watch) -> str:
    name = os.path.relpath(path, watch)
    base = os.path.basename(name)
    if name == TRACKER or (os.sep in name and base in COLUMNS):
        return base
    if os.sep in name and base.endswith(".distcp"):
        return "*.distcp"
    return name  # something else under the checkpoint directory: listed under "other"


def site(stack) -> str:
    """Innermost megatron_jreg frames (3, inner first, then the first outside its checkpoint
    package); the library function the innermost one called; the frame that opened."""
    def short(frame):
        for mark in ("megatron_jreg" + os.sep, "site-packages" + os.sep, "lib" + os.sep):
            if mark in frame:
                return (mark if mark.startswith("megatron_jreg") else "") + frame.split(mark, 1)[1]
        return frame
    ours = [i for i, f in enumerate(stack) if "megatron_jreg" + os.sep in f]
    # the way into megatron_jreg/checkpoint/ from the rest of the package, when not among them
    entry = [i for i in ours if os.sep + "checkpoint" + os.sep not in stack[i]][:1]
    shown = ours[:3] + [i for i in entry if i > ours[2]] if len(ours) > 3 else ours
    via = f"via {short(stack[ours[0] - 1])}, " if ours and ours[0] > 1 else ""
    return " < ".join(short(stack[i]) for i in shown) + f"   [{via}opened in {short(stack[0])}]"


def measure(kind, saved, data, work, repo, env, repeats):
    """A warm-up and ``repeats`` timed launches of one start: (median seconds to the first step,
    the opens per column of each timed launch, the first one's opens, median first open to step)."""
    times, spans, counts, first_recs = [], [], [], None
    src, other = os.path.join(work, f"src_{kind}"), os.path.join(work, f"other_{kind}")
    for i in range(repeats + 1):
        for d in (src, other):
            shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(saved, src)
        if kind == "resume":
            argv = ["--model-preset", "tiny", *data, "--load", src, "--save", src, "--train-iters",
                    "6"]
        else:
            argv = [*data, "--pretrained-checkpoint", src, "--use-checkpoint-args", "--save", other,
                    "--train-iters", "2"]
        seconds, first, recs, package = launch(argv, src, os.path.join(work, f"opens_{kind}.jsonl"),
                                               repo, env)
        if i == 0 and kind == "resume":
            print(f"child's megatron_jreg: {package}" + ("" if package.startswith(repo + os.sep)
                  else f"  WARNING: not under --repo {repo}"), flush=True)
        print(f"{kind} {'warm-up' if i == 0 else f'{i}/{repeats}'}: first step after {seconds:.2f} "
              "s, "
              f"{len(recs)} opens of the source checkpoint before it", flush=True)
        if i:
            recs = [dict(r, col=column(r["path"], src)) for r in recs]
            first_recs = first_recs or recs
            times.append(seconds)
            spans.append(first - min((r["t"] for r in recs), default=first))
            # other: lock files, write checks (a random name) under the checkpoint directory
            counts.append(collections.Counter(r["col"] if r["col"] in COLUMNS else "other"
                                              for r in recs))
    if any(c != counts[0] for c in counts):
        print(f"NOTE {kind}: the opens differ between launches: {[dict(c) for c in counts]}")
    return statistics.median(times), counts, first_recs, statistics.median(spans)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed launches per start (median)")
    parser.add_argument("--workdir", default=None,
                        help="work in this directory and keep it (default: a temp dir, removed)")
    parser.add_argument("--repo", default=None, help="the checkout whose trainer and tools run "
                        "(default: the current directory when it is one, else this script's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    repo = os.path.abspath(args.repo or default_repo())
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1",
               MEGATRON_JREG_DEVICE="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo, env.get("PYTHONPATH")) if p)
    [env.pop(key, None)
     for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")]
    work = args.workdir or tempfile.mkdtemp(prefix="ckpt_startup_")
    os.makedirs(work, exist_ok=True)  # a kept --workdir: its old checkpoint removed below
    try:
        corpus, prefix = os.path.join(work, "corpus.jsonl"), os.path.join(work, "demo")
        run([sys.executable, "tools/make_demo_corpus.py", "--output", corpus, "--max-mb", "0.1"],
            repo, env, "make_demo_corpus")
        run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix",
             prefix,
             "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"], repo, env,
            "preprocess_data")
        data = ["--seq-length", "64", "--data-path", prefix + "_text_document", "--tokenizer-type",
                "ByteTokenizer", "--micro-batch-size", "4", "--global-batch-size", "8",
                "--log-interval", "1", "--eval-interval", "0", "--lr", "3e-3", "--lr-warmup-iters",
                "0", "--lr-decay-iters", "6", "--jreg-lambda", "1.0", "--jreg-alpha", "1.0",
                "--seed", "1234"]
        saved = os.path.join(work, "ckpt")
        shutil.rmtree(saved, ignore_errors=True)
        run([sys.executable, "-m", "megatron_jreg.train", "--model-preset", "tiny", *data,
             "--train-iters", "4", "--save", saved, "--save-interval", "4"], repo, env,
            "the 4-step run")
        print(f"saved {saved}: {os.listdir(saved)}, iter_0000004/: "
              f"{os.listdir(saved + '/iter_0000004')}")
        results = {kind: measure(kind, saved, data, work, repo, env, args.repeats)
                   for kind in ("resume", "pretrained")}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\nopens of the source checkpoint's files before the first logged step "
          f"(iter_0000004/ and the tracker), and launch to first step (median of {args.repeats}):")
    print("| start | " + " | ".join(COLUMNS)
          + " | other | s to first step | s first open to step |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    for kind, (seconds, counts, _, span) in results.items():
        print(f"| {kind} | " + " | ".join(str(counts[0][c]) for c in COLUMNS + ("other",)) +
              f" | {seconds:.2f} | {span:.2f} |")
    for kind, (_, _, recs, _) in results.items():
        print(f"\n{kind}: call sites (count, file; innermost megatron_jreg frames < ...):")
        sites = collections.Counter((r["col"] + (" (write)" if r["write"] else ""),
                                     site(r["stack"]))
                                    for r in recs)
        for (col, where), n in sorted(sites.items()):
            print(f"  {n:3d}  {col:20s} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
