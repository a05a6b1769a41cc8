r"""tools/preprocess_data.py on a JSONL whose one line is a long document: peak memory.

For each tokenizer (ByteTokenizer; a sentencepiece BPE and a Hugging Face byte-level BPE,
both trained here, offline) it runs the tool as a command on a file of one ``--line-mb`` MB
line and one short line, polls the resident set of the whole process tree (the tool and its
workers), and prints the peak, the peak over the tool's start-up peak (a 1-line input), and
that growth over the line's size. With ``--baseline-repo`` (another checkout, e.g. the
commit before the fix) the same runs are made with its tool in the same invocation, so the
two columns share the machine and its load, and the outputs are compared byte for byte.

    python bench/preprocess_long_line.py --line-mb 2 --tokenizers ByteTokenizer \
        --baseline-repo OTHER_CHECKOUT

(``--line-mb`` is 100 by default, and every tokenizer runs without ``--tokenizers``;
OTHER_CHECKOUT is another checkout of the repository, e.g. the commit before a change.)

``--kill-gb`` stops a run whose tree passes that many GB (reported as killed).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_jreg.data.tokenizers.training import (  # noqa: E402
    TrainTokenizerConfig,
    train_sentencepiece,
)

WORDS = ("the quick brown fox jumps over lazy dog return number of items in a container raise "
         "TypeError otherwise tokenizers split text into pieces map to integer ids checkpoint "
         "holds model weights optimizer state at one step 2024 x=1.5, (see below).").split()


def make_line(path: str, megabytes: float, seed: int = 0) -> int:
    """One ASCII document of about ``megabytes`` MB (paragraphs of random words), then a short
    one; returns the file's size."""
    rng = random.Random(seed)
    paragraph = " ".join(rng.choice(WORDS) for _ in range(200_000))
    count = max(1, round(megabytes * 1e6 / (len(paragraph) + 2)))
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "\n\n".join([paragraph] * count)}) + "\n")
        f.write(json.dumps({"text": "a short one"}) + "\n")
    return os.path.getsize(path)


def train_tokenizers(work: str) -> dict[str, list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = os.path.join(work, "train.jsonl")
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(400)]
    with open(corpus, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    sp = train_sentencepiece(TrainTokenizerConfig(
        input=[corpus], model_prefix=os.path.join(work, "sp"), vocab_size=400))
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_path = os.path.join(work, "tokenizer.json")
    hf.save(hf_path)
    return {"ByteTokenizer": ["--tokenizer-type", "ByteTokenizer"],
            "sentencepiece": ["--tokenizer-type", "SentencePieceTokenizer",
                              "--tokenizer-model", sp],
            "HuggingFace": ["--tokenizer-type", "HuggingFaceTokenizer",
                            "--tokenizer-model", hf_path]}


def tree_peak(argv: list[str], kill_bytes: int) -> tuple[int, float, str]:
    """(peak resident bytes of the command and its children, wall seconds, outcome)."""
    start = time.perf_counter()
    proc = psutil.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    while proc.poll() is None:
        total = 0
        try:
            for p in [proc, *proc.children(recursive=True)]:
                total += p.memory_info().rss
        except psutil.Error:
            pass
        peak = max(peak, total)
        if peak > kill_bytes:
            for p in proc.children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()
            proc.stderr.close()
            return peak, time.perf_counter() - start, "killed"
        time.sleep(0.005)
    err = proc.stderr.read().decode().strip()
    proc.stderr.close()
    outcome = "ok" if proc.returncode == 0 else f"rc {proc.returncode}: {err[-200:]}"
    return peak, time.perf_counter() - start, outcome


def run(repo: str, data: str, prefix: str, flags: list[str], kill_bytes: int):
    tool = os.path.join(repo, "tools", "preprocess_data.py")
    return tree_peak([sys.executable, tool, "--input", data, "--output-prefix", prefix,
                      *flags, "--append-eod", "--overwrite"], kill_bytes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--line-mb", type=float, default=100.0)
    p.add_argument("--baseline-repo", default=None,
                   help="another checkout whose tool runs the same inputs (e.g. old main)")
    p.add_argument("--tokenizers", nargs="+", default=None,
                   help="ByteTokenizer, sentencepiece, HuggingFace (default: all)")
    p.add_argument("--kill-gb", type=float, default=8.0)
    p.add_argument("--workdir", default=None, help="default: a temp dir, removed afterwards")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or tmp
        os.makedirs(work, exist_ok=True)
        data = os.path.join(work, "long.jsonl")
        size = make_line(data, args.line_mb)
        tiny = os.path.join(work, "tiny.jsonl")
        with open(tiny, "w") as f:
            f.write('{"text": "a short one"}\n')
        tokenizers = train_tokenizers(work)
        if args.tokenizers:
            tokenizers = {k: v for k, v in tokenizers.items() if k in args.tokenizers}
        repos = {"this": REPO}
        if args.baseline_repo:
            repos = {"baseline": os.path.abspath(args.baseline_repo), "this": REPO}
        kill = int(args.kill_gb * 1e9)
        print(f"one line of {size / 1e6:.1f} MB; peak RSS of the process tree; growth = "
              f"peak - start-up peak (1-line input); kill at {args.kill_gb:g} GB")
        for name, flags in tokenizers.items():
            outputs = {}
            for label, repo in repos.items():
                start_up, _, _ = run(repo, tiny, os.path.join(work, "tiny"), flags, kill)
                prefix = os.path.join(work, f"{label}_{name}")
                peak, wall, outcome = run(repo, data, prefix, flags, kill)
                growth = peak - start_up
                print(f"  {name:<14} {label:<9} peak {peak / 2**20:7.0f} MiB "
                      f"({peak / size:5.2f}x the line), growth {growth / size:5.2f}x the line, "
                      f"start-up {start_up / 2**20:4.0f} MiB, {wall:6.1f} s, {outcome}")
                if outcome == "ok":
                    outputs[label] = prefix + "_text_document"
            if len(outputs) == 2:
                same = all(filecmp.cmp(outputs["baseline"] + ext, outputs["this"] + ext,
                                       shallow=False) for ext in (".bin", ".idx"))
                print(f"  {name:<14} outputs {'identical' if same else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
