"""The prepared GPU checks, one run, one summary table (bash bench/gpu_checks.sh calls this).

Time budget: the per-check limits of the CUDA plan (LIMITS_S below, printed by --help)
add up to at most BUDGET_S = 480 s, asserted in code, so that preflight, the kernel build
and every check fit one 10-minute command. A check that runs past its limit is killed with
its whole process group (each check starts in a session of its own), so nothing it started
stays on the GPU; it is recorded as a timeout and the rest still run.

First a preflight, one line per requirement: the interpreter, pip, every import the checks
need (torch, numpy, megatron.core, the package's modules, pytest for the GPU tests), the
kernel extension, nvcc's version and the GPU's name and memory. A missing one stops the
run before any check (exit 2), the line naming it and the fix. ``--preflight-only`` stops
after it (gpu_checks.sh runs that before the install).

Written where: each check's row is appended to a JSONL file the moment it finishes, and
printed (``$OUT/gpu_checks.jsonl`` when ``$OUT`` is set, else bench/gpu_checks.jsonl beside
this script; ``--jsonl`` names another). The file's first row holds the run and its
preflight; then one row per check: check, status (ok, skipped, FAIL (rc), timeout), the
key figure, seconds, the limit, the command, the check's ``RESULT`` json and, on failure,
the output's tail. A run cut off mid-way keeps every finished check's row. The summary
table at the end has one row per check: status, key figure, seconds.

Checks, in order (the most telling first, for a run that is cut): the fused kernel's
largest error against float64 per dtype (bench/kernel_accuracy.py); the GPU-marked tests;
the trainer saving a checkpoint and resuming from it, lm losses against an uninterrupted
run (bench/trainer_resume_check.py), and the same with the checkpoint saved on the CPU and
resumed on the GPU, with dropout (its random state is the CUDA form of the CPU run's seeds:
the resume sets it as Megatron-LM does, without --no-load-rng); save and load time and size
per checkpoint format (plain, fully parallel, async; dp_reshardable, fully_reshardable) and
the step time while an async save is written (bench/checkpoint_formats.py); the fused op's
bandwidth against the GPU's peak; JREG's step overhead at the 170m preset's dimensions;
context parallelism's step time and memory per rank at CP1 and CP2 over one sequence of 16k
tokens, CP2's loss and Psi against CP1's (bench/context_parallel_step.py; with one GPU CP1
alone, CP2 skipped); the 3B script's model flags (bf16) at 2 layers with the local spec
(with selective recompute of layernorm) and, when installed, Transformer Engine (which
folds the norm into its linears: nothing to recompute there); tokens/s, TFLOP/s and MFU of
1b training steps (seq 2048, bf16) with PyTorch SDPA and Transformer Engine attention, JREG
off and on, and JREG's overhead from each pair. ``--device cpu --quick`` runs the same
sequence at toy sizes (a smoke test of this script; no GPU figures, the GPU tests left
out).
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # the preflight imports this checkout's package, as the checks do

# Seconds each check of the CUDA plan may take on one H200 (a ceiling, not its usual
# time; the model steps take 2 warm-up and 3 timed steps). Their sum leaves 120 s of the
# 600 s command to preflight and the kernel build. (The checkpoint formats' 40 s came out of
# the GPU tests' and the trainer resume's ceilings, 10 s each, and the 1b steps', 5 s each;
# the resume of a CPU save's 50 s out of the 1b steps', 5 s each, JREG's overhead's, 10 s,
# and the 3b flags', 10 s each; context parallelism's 30 s out of the kernel accuracy's,
# the two resumes', the checkpoint formats', the op bandwidth's and JREG's overhead's, 5 s
# each; none of them has been timed on a GPU yet.)
BUDGET_S = 480
LIMITS_S = {
    "kernel accuracy": 20,
    "gpu tests": 50,
    "trainer resume": 60,
    "resume of a CPU save": 45,
    "checkpoint formats": 35,
    "op bandwidth": 30,
    "JREG step overhead": 40,
    "context parallel CP1 vs CP2": 30,
    "3b flags x2, local": 25,
    "3b flags x2, TE": 25,
    "1b sdpa, JREG off": 30,
    "1b sdpa, JREG on": 30,
    "1b TE, JREG off": 30,
    "1b TE, JREG on": 30,
}
assert sum(LIMITS_S.values()) <= BUDGET_S, (
    f"the checks' limits add up to {sum(LIMITS_S.values())} s > {BUDGET_S} s")
CPU_LIMIT_S = 300  # per check of the CPU plan (toy sizes on a shared machine; no budget)
JSONL_NAME = "gpu_checks.jsonl"


def default_jsonl() -> str:
    out = os.environ.get("OUT")
    return os.path.join(out, JSONL_NAME) if out else os.path.join(HERE, JSONL_NAME)


# ---- preflight ------------------------------------------------------------------------------
# the package's modules the checks import (the trainer's imports cover the data tools')
PACKAGE_MODULES = ("megatron_jreg.ops", "megatron_jreg.model.builder",
                   "megatron_jreg.training.step",
                   "megatron_jreg.training.optimizer", "megatron_jreg.training.trainer",
                   "megatron_jreg.data.preprocess.pipeline", "megatron_jreg.train")
INSTALL = "python3 -m pip install --no-build-isolation --no-deps -e ."


class Preflight:
    """Prints one line per requirement; ``ok`` is False once a needed one is missing."""

    def __init__(self, quiet: bool = False):
        self.ok, self.lines, self.quiet = True, {}, quiet

    def report(self, what: str, text: str, fix: str = "") -> None:
        if fix:
            self.ok = False
            text = f"MISSING: {text}; fix: {fix}"
        self.lines[what] = text
        if fix or not self.quiet:
            print(f"preflight: {what}: {text}", flush=True)


def _version(module) -> str:
    version = getattr(module, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(module.__name__.split(".")[0].replace("_", "-"))
        except PackageNotFoundError:
            version = "?"
    return str(version)


def _import(p: Preflight, name: str, needed: bool, fix: str, note: str = ""):
    try:
        module = importlib.import_module(name)
    except Exception as err:  # ImportError, or a broken build raising anything at import
        missing = getattr(err, "name", None) or name
        p.report(name, f"{type(err).__name__}: {err}" + (f" ({note})" if note else ""),
                 fix.format(missing=missing) if needed else "")
        return None
    p.report(name, f"{_version(module)}" + (f" ({note})" if note else ""))
    return module


def _kernel_state():
    """(importable, CUDA kernel built, why not importable)."""
    try:
        from megatron_jreg import _C
    except ImportError as err:
        return False, False, str(err)
    return True, bool(_C.cuda_built()), ""


def _nvcc():
    """Path of nvcc (PATH, then torch's CUDA_HOME) or None."""
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:
        return None
    candidate = CUDA_HOME and os.path.join(CUDA_HOME, "bin", "nvcc")
    return candidate if candidate and os.path.exists(candidate) else None


def preflight(device: str, before_install: bool, quiet: bool = False) -> Preflight:
    """The requirements of the checks on ``device``; ``before_install``: the kernel is not
    required yet (gpu_checks.sh builds it next), the build's tools are; ``quiet``: print
    only a missing one's line."""
    with warnings.catch_warnings():  # the libraries' own import-time warnings
        warnings.simplefilter("ignore")
        return _preflight(device, before_install, Preflight(quiet))


def _preflight(device: str, before_install: bool, p: Preflight) -> Preflight:
    cuda = device == "cuda"
    p.report("interpreter", f"{sys.executable} (Python {sys.version.split()[0]})")
    pip_fix = (f"install one: {sys.executable} -m pip install <package> (a wheel, offline), "
               "or its package manager's")
    try:
        import torch

        note = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    except Exception:
        note = ""
    torch = _import(p, "torch", True, "install a torch build (the CUDA one on a GPU machine)", note)
    _import(p, "numpy", True, pip_fix.replace("<package>", "numpy"))
    _import(p, "megatron.core", True, pip_fix.replace("<package>", "megatron-core==0.16.1"))
    failed = []
    for name in PACKAGE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as err:
            failed.append(f"{name} ({type(err).__name__}: {err})")
    p.report("package modules",
             "ok: " + ", ".join(m.replace("megatron_jreg.", "") for m in PACKAGE_MODULES)
             if not failed else "; ".join(failed),
             "" if not failed else f"install what they import ({pip_fix}); run from the checkout")
    _import(p, "pytest", cuda, pip_fix.replace("<package>", "pytest"),
            "the GPU tests" if cuda else "not needed on cpu")
    try:
        importlib.import_module("tensorboard")
        p.report("tensorboard", "installed (not needed: the checks set no --tensorboard-dir)")
    except ImportError:
        p.report("tensorboard", "not installed (not needed: the checks set no --tensorboard-dir)")
    p.report("transformer_engine", "installed" if te_available()
             else "not installed (its checks are skipped)")

    importable, cuda_built, why = _kernel_state()
    ready = importable and (cuda_built or not cuda)
    build_needed = before_install and not ready
    for name in ("pip", "setuptools"):
        _import(p, name, build_needed, f"{sys.executable} -m ensurepip --upgrade (offline)",
                "not needed: the kernel is built" if ready else "for the kernel build")
    if importable:
        state = f"built, CUDA kernel {'yes' if cuda_built else 'no'}"
    else:
        state = f"not built ({why})"
    kernel_fix = "" if ready or before_install else (
        f"{INSTALL} (needs nvcc and a CUDA build of torch for the CUDA kernel)")
    p.report("megatron_jreg._C",
             state + (" (gpu_checks.sh builds it next)" if before_install and not ready else ""),
             kernel_fix)

    nvcc = _nvcc()
    if nvcc:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        release = [line for line in proc.stdout.splitlines() if "release" in line]
        p.report("nvcc",
                 f"{nvcc}: {(release or proc.stdout.splitlines()[-1:] or ['?'])[0].strip()}")
    elif not cuda:
        p.report("nvcc", "not found (skipped: cpu)")
    else:
        p.report("nvcc", "not found on PATH nor in CUDA_HOME/bin",
                 "" if cuda_built else "put the CUDA toolkit's bin on PATH or set CUDA_HOME")
    if not cuda:
        p.report("gpu", "skipped (cpu)")
    elif torch is None:
        p.report("gpu", "torch did not import", "see the torch line")
    elif not torch.cuda.is_available():
        p.report("gpu",
                 f"no CUDA device visible (torch {torch.__version__}, CUDA {torch.version.cuda})",
                 "a CUDA build of torch and a visible GPU (nvidia-smi; CUDA_VISIBLE_DEVICES)")
    else:
        props = torch.cuda.get_device_properties(0)
        p.report("gpu", f"{torch.cuda.get_device_name(0)}, {props.total_memory / 2**30:.1f} GiB, "
                 f"compute capability {props.major}.{props.minor}, {torch.cuda.device_count()} "
                 "visible")
    return p


def te_available() -> bool:
    """Whether Transformer Engine imports (False where the package itself does not import:
    the preflight has said so on its own line)."""
    try:
        from megatron_jreg.config.model import transformer_engine_available
    except Exception:
        return False
    return transformer_engine_available()


# ---- the checks -----------------------------------------------------------------------------
def checks(device: str, quick: bool):
    """[(name, command, limit seconds)] of the plan for ``device``."""
    py = sys.executable
    cuda = device == "cuda"
    if quick:
        toy = ["--vocab", "512", "--warmup", "1", "--timed-steps", "2"]
        one_b = ["--preset", "tiny", "--seq", "64", "--micro-batch", "2"] + toy
        three_b = ["--preset", "tiny", "--layers", "2", "--seq", "64", "--micro-batch", "1"] + toy
        op = ["--shape", "64", "2", "128", "--iters", "2"]
        accuracy = ["--shape", "64", "2", "128"]
        overhead = ["--layers", "2", "--hidden", "128", "--seq", "64", "--micro-batch", "2",
                    "--vocab", "512", "--timed-steps", "2"]
        formats = ["--preset", "tiny", "--vocab", "512", "--seq", "64"]
        context = ["--layers", "1", "--hidden", "128", "--seq", "256", "--vocab", "512", "--steps",
                   "1"]
    else:
        # seq 2048 (the presets'), bf16, micro-batch 8
        timed = ["--warmup", "2", "--timed-steps", "3"]
        one_b = ["--preset", "1b", "--micro-batch", "8"] + timed
        three_b = ["--preset", "3b", "--layers", "2", "--micro-batch", "2"] + timed
        op = ["--dtype", "bf16"]
        accuracy = []
        overhead = ["--layers", "12", "--hidden", "768", "--seq", "2048", "--micro-batch", "8",
                    "--vocab", "32000", "--timed-steps", "7"]
        # one 1b layer, bf16: 84M parameters, about 1.2 GB a checkpoint, six saves and twelve
        # loads (the sizes that fit 40 s by estimate: no GPU run has timed it yet)
        formats = ["--nproc", "1", "--bf16", "--preset", "1b", "--layers", "1", "--vocab", "8000",
                   "--seq", "2048", "--micro-batch", "1"]
        # two 1b-wide layers over one sequence of 16k tokens (bf16): on one GPU CP1 alone
        context = ["--layers", "2", "--hidden", "2048", "--seq", "16384", "--vocab", "32000",
                   "--steps", "3"]
    step = [py, "bench/gpu_model_step.py", "--device", device]
    layernorm = ["--recompute-modules", "layernorm"]
    plan = [("kernel accuracy", [py, "bench/kernel_accuracy.py", "--device", device] + accuracy)]
    if cuda:
        # -o addopts=: one process (pytest.ini asks for pytest-xdist workers, which the GPU
        # machine may not have)
        plan.append(("gpu tests",
                     [py, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
                      "-m", "gpu", "tests/ops", "tests/platform"]))
    plan += [
        ("trainer resume", [py, "bench/trainer_resume_check.py", "--device", device]),
        ("resume of a CPU save", [py, "bench/trainer_resume_check.py", "--device", device,
                                  "--save-device", "cpu", "--dropout", "0.1"]),
        ("checkpoint formats", [py, "bench/checkpoint_formats.py", "--device", device] + formats),
        ("op bandwidth", [py, "bench/displacement_op.py", "--device", device] + op),
        ("JREG step overhead", [py, "bench/jreg_overhead.py", "--device", device] + overhead),
        ("context parallel CP1 vs CP2", [py, "bench/context_parallel_step.py", "--device", device]
         + context),
        ("3b flags x2, local", step + three_b + ["--transformer-impl", "local"] + layernorm),
        ("3b flags x2, TE", step + three_b + ["--transformer-impl", "transformer_engine"]),
    ]
    # tokens/s and MFU per attention, JREG off (lambda 0 still measures) and on; each
    # off/on pair gives JREG's overhead
    for attention in ("sdpa", "TE"):
        impl = ["--transformer-impl", "transformer_engine" if attention == "TE" else "local"]
        backend = ["--attention-backend", "auto" if attention == "TE" else attention]
        for lam in ("0", "1"):
            name = f"1b {attention}, JREG {'on' if lam == '1' else 'off'}"
            plan.append((name, step + one_b + impl + backend + ["--jreg-lambda", lam]))
    return [(name, cmd, LIMITS_S[name] if cuda else CPU_LIMIT_S) for name, cmd in plan]


def plan_limit_s(device: str = "cuda", quick: bool = False) -> int:
    """The sum of the plan's per-check limits (the CUDA plan's is at most BUDGET_S)."""
    return sum(limit for _, _, limit in checks(device, quick))


def needs_te(name: str) -> bool:
    return name.endswith(", TE") or " TE," in name


# ---- running one check ----------------------------------------------------------------------
@dataclass
class CheckRun:
    code: object  # the exit status, or "timeout"
    output: str
    seconds: float
    pgid: int  # the check's process group (all of it is gone when run_check returns)


def die_with_parent() -> None:
    """In a child (a check's first process, the resume check's trainers): SIGKILL when
    its parent dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


CURRENT_GROUP = []  # the running check's process group, for the signal handler


def run_check(cmd, limit: float, env=None, cwd: str = REPO, echo=True) -> CheckRun:
    """Runs ``cmd`` in a new session for at most ``limit`` seconds, echoing its output as it
    comes; then kills whatever of its process group is left (all of it on a timeout)."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True,
                            preexec_fn=die_with_parent)
    CURRENT_GROUP[:] = [proc.pid]
    lines = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if echo:
                print("  " + line, end="", flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        code = "timeout"
    _kill_group(proc.pid)  # on success too: a check leaves nothing running
    proc.wait()
    CURRENT_GROUP[:] = []
    reader.join(timeout=5)  # a process that escaped the group may hold the pipe
    return CheckRun(code, "".join(lines), time.time() - t0, proc.pid)


def result_json(output: str):
    """The check's last ``RESULT {json}`` line, or None."""
    found = re.findall(r"^RESULT (\{.*\})\s*$", output, re.M)
    if not found:
        return None
    try:
        return json.loads(found[-1])
    except json.JSONDecodeError as err:
        return {"unreadable": f"{err}: {found[-1][:200]}"}


def key_figure(name: str, output: str, result) -> str:
    """The figure a reader wants from a check's output."""
    if name == "gpu tests":
        m = re.search(r"(\d+ passed[^\n]*)", output)
        return m.group(1).strip("= ") if m else ""
    if name == "kernel accuracy" and result:
        return "; ".join(f"{d} psi {e['psi']:.1e}, grad {max(e['grad_a'], e['grad_b']):.1e}"
                         for d, e in result["errors"].items())
    if name in ("trainer resume", "resume of a CPU save") and result:
        steps = result["steps_compared"]
        return (f"lm loss max abs diff {result['max_abs_diff']:.3g} (rel "
                f"{result['max_rel_diff']:.3g}), "
                f"steps {steps[0]}-{steps[-1]} resumed from {result['resumed_from']}, "
                f"{result['precision']}"
                + (f", saved on {result['save_device']}"
                   if result.get("save_device", result["device"])
                   != result["device"] else ""))
    if name == "checkpoint formats" and result:
        return checkpoint_formats_figure(result)
    if name == "op bandwidth":
        found = re.findall(r"fused (forward|backward)\s+([\d.]+) GB/s(?: = ([\d.]+)% of peak)?",
                           output)
        if found:
            return ", ".join(f"{p} {g} GB/s" + (f" ({pc}% of peak)" if pc else "")
                             for p, g, pc in found)
        m = re.search(r"ratio fused/reference: [^\n]*", output)
        return m.group(0) if m else ""
    if name == "JREG step overhead":
        found = re.findall(r"JREG (\w+)\s+step time\s+([\d.]+) s \(\s*([\d.]+)x off\)", output)
        return ", ".join(f"{v} {x}x" for v, _, x in found if v != "off")
    if name == "context parallel CP1 vs CP2" and result:
        return context_parallel_figure(result)
    if not result:
        return ""
    text = f"{result['tokens_per_s']:,.0f} tok/s, {result['tflops']:.1f} TFLOP/s"
    if result.get("attention"):
        text += f", attention {result['attention']}"
    if result.get("mfu") is not None:
        text += f", MFU {100 * result['mfu']:.1f}%"
    if result.get("peak_mem_gib") is not None:
        text += f", {result['peak_mem_gib']:.1f} GiB"
    ok = result.get("lm_loss") is not None and result.get("psi_finite")
    return text + ("" if ok else ", NON-FINITE loss/psi")


def context_parallel_figure(result) -> str:
    """CP2 against CP1 at one sequence: step time and memory per rank, and the loss check;
    or CP1's figures and why CP2 did not run."""
    cp1, seq = result["cp1"], f"seq {result['seq']}"
    memory = "GiB allocated" if result["device"] == "cuda" else "MiB saved activations"
    unit = 2**30 if result["device"] == "cuda" else 2**20
    key = "peak_bytes_per_rank" if result["device"] == "cuda" else "saved_bytes_per_rank"
    if result["cp2"] is None:
        return (f"{seq}: CP1 {cp1['tokens_per_s']:,.0f} tok/s, {cp1[key] / unit:.2f} {memory}; "
                f"CP2 skipped: {result['cp2_skipped']}")
    ratios, check = result["ratios"], result["check"]
    diff = "not finite" if check["max_rel_diff"] is None else f"{check['max_rel_diff']:.1e}"
    return (f"{seq}: CP2/CP1 step time {ratios['step_s']:.2f}x, saved activations/rank "
            f"{ratios['saved_bytes_per_rank']:.2f}x, "
            f"peak memory/rank {ratios['peak_bytes_per_rank']:.2f}x; "
            f"loss and Psi rel diff {diff}")


def checkpoint_formats_figure(result) -> str:
    """Per optimizer format: the plain, fully parallel and async saves (the loop blocked,
    then whole), the plain load, and the step time while an async save was written."""
    parts = []
    for fmt in ("dp_reshardable", "fully_reshardable"):
        row = {r["save"]: r for r in result["rows"] if r["format"] == fmt}
        during = row["async"]["step_s_during_write"]
        parts.append(f"{fmt} {row['plain']['bytes'] / 1e9:.2f} GB: "
                     f"save {row['plain']['whole_s']:.2f}s "
                     f"plain, {row['fully parallel']['whole_s']:.2f}s fully parallel, async blocks "
                     f"{row['async']['blocked_s']:.2f}s (whole {row['async']['whole_s']:.2f}s), "
                     f"load {row['plain']['load_s']:.2f}s; step during the write "
                     + (f"{during / result['step_s']:.2f}x" if during else "none"))
    return "; ".join(parts)


def overhead_rows(rows):
    """JREG on / off step time for each model-step pair that ran: the overhead at that size."""
    out = []
    results = {r["check"]: r["figure"] for r in rows if r["status"] == "ok"}
    for name, figure in results.items():
        if not name.endswith("JREG on"):
            continue
        off = results.get(name[:-len("on")] + "off")
        tok_on = re.match(r"([\d,]+) tok/s", figure)
        tok_off = re.match(r"([\d,]+) tok/s", off or "")
        if tok_on and tok_off:
            ratio = (float(tok_off.group(1).replace(",", ""))
                     / float(tok_on.group(1).replace(",", "")))
            out.append({"check": name[:-len(", JREG on")] + ": JREG on/off step time",
                        "status": "ok",
                        "figure": f"{ratio:.3f}x", "seconds": 0.0, "derived": True})
    return out


class RunError(Exception):
    """A problem with how the run was asked for (its message is the one line to print)."""


def _finite(value):
    """``value`` with every non-finite float as a string ("nan", "inf"): JSON has no NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class Jsonl:
    """The run's JSONL file: taken for this run alone (a lock: a second run on the same file
    stops at once), started afresh, one row appended and synced per call."""

    def __init__(self, path: str):
        self.path = path
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a")
        except OSError as err:
            raise RunError(f"the rows file {path}: cannot write there ({err.strerror or err}); "
                           f"pass --jsonl FILE, or set OUT to a writable directory") from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RunError(f"the rows file {path}: another gpu_checks run is writing it; "
                           "wait for it "
                           "or pass another --jsonl") from None
        self._file.truncate(0)

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(_finite(row), allow_nan=False) + "\n")
        self._file.flush()
        try:
            os.fsync(self._file.fileno())
        except OSError:  # a file that cannot be synced (a pipe, /dev/null): written all the same
            pass


def print_summary(rows, device: str, quick: bool, te: bool) -> None:
    width = max(len(r["check"]) for r in rows)
    print(f"\nsummary ({device}{', quick' if quick else ''}; Transformer Engine "
          f"{'installed' if te else 'not installed'})")
    print(f"| {'check':{width}s} | status   | figure | s |")
    print(f"|{'-' * (width + 2)}|----------|--------|---|")
    for r in rows:
        print(f"| {r['check']:{width}s} | {r['status']:8s} | {r['figure']} | {r['seconds']:.0f} |")


def main() -> int:
    limits = "\n".join(f"  {name:28s} {limit:4d} s" for name, limit in LIMITS_S.items())
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"limits of the CUDA plan (sum {sum(LIMITS_S.values())} s <= {BUDGET_S} "
               f"s):\n{limits}")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true",
                        help="toy sizes (a smoke test of this script)")
    parser.add_argument("--jsonl", default=None,
                        help=f"where the rows go (default $OUT/{JSONL_NAME} when $OUT is set, else "
                        f"bench/{JSONL_NAME}; now {default_jsonl()})")
    parser.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the checks whose name contains one of these (e.g. 'trainer' "
                             "'1b TE')")
    parser.add_argument("--preflight-only", action="store_true",
                        help="stop after the preflight (gpu_checks.sh: before the kernel build)")
    parser.add_argument("--quiet-preflight", action="store_true",
                        help="print only a missing requirement's line (gpu_checks.sh printed them "
                             "all)")
    args = parser.parse_args()
    try:
        return run_plan(args)
    except RunError as err:
        print(f"gpu_checks: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpu_checks: interrupted before any check ran; nothing written", file=sys.stderr)
        return 130


def run_plan(args) -> int:
    plan = checks(args.device, args.quick)
    if args.only:
        wanted = [text.lower() for text in args.only]
        plan = [c for c in plan if any(text in c[0].lower() for text in wanted)]
        if not plan:
            names = ", ".join(repr(name) for name, _, _ in checks(args.device, args.quick))
            raise RunError(f"--only {' '.join(args.only)}: no check of the {args.device} plan has "
                           f"that in its name; the checks: {names}")
    # the output is taken first: a bad --jsonl or a second run stops before the preflight
    jsonl = None if args.preflight_only else Jsonl(args.jsonl or default_jsonl())
    pre = preflight(args.device, before_install=args.preflight_only, quiet=args.quiet_preflight)
    if not pre.ok:
        print("preflight: a requirement is missing (the MISSING line above says the fix); "
              "no check ran")
        return 2
    if args.preflight_only:
        return 0
    te = te_available()
    total = sum(limit for _, _, limit in plan)
    print(f"preflight: ok; {len(plan)} checks, limits {total} s in all; a row per check goes to "
          f"{jsonl.path}", flush=True)
    jsonl.write({"run": "gpu_checks", "device": args.device, "quick": args.quick, "te": te,
                 "limit_sum_s": total, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "preflight": pre.lines})
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    rows = []

    def on_signal(signum, frame):  # the command is being cut: end the running check too
        for pgid in CURRENT_GROUP:
            _kill_group(pgid)
        jsonl.write({"cut": signal.Signals(signum).name, "after_checks": len(rows)})
        print(f"\n{signal.Signals(signum).name}: stopped; {len(rows)} checks' rows are in "
              f"{jsonl.path}", flush=True)
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)

    for name, cmd, limit in plan:
        row = {"check": name, "limit_s": limit, "command": " ".join(cmd[1:])}
        if needs_te(name) and not te:
            row.update(status="skipped", figure="Transformer Engine not installed", seconds=0.0)
        else:
            print(f"==> {name} (limit {limit} s): {row['command']}", flush=True)
            done = run_check(cmd, limit, env=env)
            result = result_json(done.output)
            ok = done.code == 0
            tail = done.output.strip().splitlines()[-1:] or [""]
            status = "ok" if ok else ("timeout" if done.code == "timeout"
                                      else f"FAIL ({done.code})")
            if ok and result and "unreadable" in result:
                ok, status = False, "FAIL (RESULT)"
                figure = f"its RESULT line is not JSON ({result['unreadable'][:100]})"
            elif ok:
                try:
                    figure = key_figure(name, done.output, result)
                except (KeyError, TypeError, ValueError, IndexError) as err:
                    ok, status = False, "FAIL (RESULT)"
                    figure = f"its RESULT has no usable figure ({type(err).__name__}: {err})"
            else:
                figure = f"killed after {limit} s" if done.code == "timeout" else tail[0][:120]
            row.update(status=status, figure=figure, seconds=round(done.seconds, 1), rc=done.code,
                       result=result)
            if not ok:
                row["tail"] = done.output[-3000:]
        jsonl.write(row)
        rows.append(row)
        print(f"<== {name}: {row['status']} in {row['seconds']:.0f} s: {row['figure']}", flush=True)
    for row in overhead_rows(rows):
        jsonl.write(row)
        rows.append(row)
    print_summary(rows, args.device, args.quick, te)
    spent = sum(r["seconds"] for r in rows)
    print(f"checks took {spent:.0f} s of their {total} s of limits; rows in {jsonl.path}")
    return 1 if any(r["status"] not in ("ok", "skipped") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
