"""tools/preprocess_data.py against its limit: the tokenizer's own batch-encode time.

For each tokenizer (a Hugging Face byte-level BPE and a sentencepiece BPE, both trained here
on the bench corpus, offline) and each worker count, it prints:

- the limit: the library's batch encode of every document of the corpus on one thread
  (``Tokenizer.encode_batch_fast``, ``SentencePieceProcessor.Encode(num_threads=1)``),
  divided by the workers; JSON parsing and writing are not in it;
- the tool's wall time, run as a command (start-up, reading, workers, writing, all of it),
  and its CPU time (itself and its workers);
- the ratio of the two. Target (issue): <= 1.5x at 2 workers;
- the floor: the same library encode run alone in as many processes as workers, each on
  its share of the corpus, and the tool's median wall time over its median. On an idle
  machine the floor equals the limit; on a shared one it says how much of the ratio is
  other people's load, not the tool;
- the CPU time of the tool and its workers, and its multiple of the encode's own CPU time:
  the work the tool adds, whatever the load.

Each figure is the median of ``--repeats`` runs, with the spread (min-max); runs are
interleaved so a busy spell on a shared machine hits every configuration alike. The load
average before and after says how busy the machine was. It also prints the fixed start-up:
the tool on a 1-document input (median of 5; target <= 0.5 s), and checks that every run
wrote the same bytes.

    python bench/preprocess_throughput.py                    # 20 MB generated corpus
    python bench/preprocess_throughput.py --corpus-mb 100 --workers 1 2 4 8

``--memory-scale 4`` also runs the tool on the corpus repeated 4 times: the peak resident
set of its largest process should not grow with the corpus.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

# The limit is one thread; set before the tokenizers library first runs.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# Run from a checkout, use that checkout's package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, iter_demo_documents  # noqa: E402
from megatron_jreg.data.tokenizers.training import (  # noqa: E402
    TrainTokenizerConfig,
    train_sentencepiece,
)

TOOL = os.path.join(REPO, "tools", "preprocess_data.py")
BATCH = 1000  # documents per library call when measuring the limit


def make_corpus(path: str, target_mb: float, seed: int = 0) -> tuple[int, int]:
    """Documents of 1-4 stdlib docstrings each, drawn with a fixed seed, up to target_mb."""
    pool = [d["text"] for d in iter_demo_documents(DemoCorpusConfig(output=path))]
    rng = random.Random(seed)
    docs = written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target_mb * 1e6:
            text = "\n\n".join(rng.sample(pool, rng.randint(1, 4)))
            line = json.dumps({"id": docs, "text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            docs += 1
            written += len(line.encode("utf-8"))
    return docs, written


def train_hf_bpe(corpus: str, out_dir: str, vocab_size: int) -> str:
    """A GPT-2 style byte-level BPE ``tokenizer.json`` trained on the corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(corpus, encoding="utf-8") as f:
        tok.train_from_iterator((json.loads(line)["text"] for line in f), trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def library_encoder(kind: str, model: str):
    """The library's own one-thread batch encode, with nothing of ours around it."""
    if kind == "HuggingFaceTokenizer":
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(model)
        return lambda texts: tok.encode_batch_fast(texts, add_special_tokens=False)
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    return lambda texts: sp.Encode(texts, num_threads=1)


def time_encode(encode, texts: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of encoding ``texts`` in batches."""
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), BATCH):
        encode(texts[i:i + BATCH])
    return time.perf_counter() - start, time.process_time() - cpu


def _time_part(job) -> float:
    kind, model, texts = job
    return time_encode(library_encoder(kind, model), texts)[0]


def time_parallel_encode(kind: str, model: str, texts: list[str], processes: int) -> float:
    """The library's encode alone, in ``processes`` processes at once, 1/n of the corpus
    each: the floor this machine delivers now (the limit assumes ``processes`` idle cores)."""
    import multiprocessing

    jobs = [(kind, model, texts[i::processes]) for i in range(processes)]
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        return max(pool.map(_time_part, jobs))


def run_tool(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU of the tool and its workers) of one run as a command."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, TOOL, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"preprocess_data.py {' '.join(argv)} failed:\n{err}")
    return wall, usage.ru_utime + usage.ru_stime


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def startup(work: str, tokenizers: dict[str, list[str]], repeats: int = 5) -> None:
    one = os.path.join(work, "one.jsonl")
    with open(one, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "A single short document."}) + "\n")
    print(f"start-up (1-document input, median of {repeats}, target <= 0.5 s):")
    for name, flags in tokenizers.items():
        walls = [run_tool(["--input", one, "--output-prefix", os.path.join(work, "one"),
                           *flags, "--append-eod", "--overwrite"])[0] for _ in range(repeats)]
        print(f"  {name:<14} {spread(walls)} s")


def peak_rss_mib(argv: list[str]) -> float:
    """Peak resident set of the largest process of a command (itself or a reaped child)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed")
    return usage.ru_maxrss / 1024  # Linux reports KiB


def memory_check(work: str, corpus: str, nbytes: int, scale: int, flags: list[str]) -> None:
    big = os.path.join(work, f"corpus_x{scale}.jsonl")
    with open(corpus, "rb") as src, open(big, "wb") as dst:
        data = src.read()
        for _ in range(scale):
            dst.write(data)
    peaks = {}
    for name, path in (("1x", corpus), (f"{scale}x", big)):
        peaks[name] = peak_rss_mib([sys.executable, TOOL, "--input", path, "--output-prefix",
                                    os.path.join(work, f"mem_{name}"), *flags, "--workers", "2",
                                    "--append-eod", "--overwrite"])
    one, many = peaks["1x"], peaks[f"{scale}x"]
    print(f"peak RSS of the largest process: {one:.1f} MiB on {nbytes / 1e6:.0f} MB, "
          f"{many:.1f} MiB on {scale * nbytes / 1e6:.0f} MB: {many / one:.3f}x for "
          f"{scale}x the corpus (flat is 1.0x)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=20.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-vocab", type=int, default=16000)
    p.add_argument("--sp-vocab", type=int, default=8000)
    p.add_argument("--memory-scale", type=int, default=0,
                   help="also run on the corpus repeated this many times (0: skip)")
    p.add_argument("--workdir", default=None, help="default: a temp dir, removed afterwards")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(dir=args.workdir) as work:
        corpus = os.path.join(work, "corpus.jsonl")
        docs, nbytes = make_corpus(corpus, args.corpus_mb)
        hf = train_hf_bpe(corpus, os.path.join(work, "hf"), args.hf_vocab)
        sp = train_sentencepiece(TrainTokenizerConfig(
            input=[corpus], model_prefix=os.path.join(work, "sp"), vocab_size=args.sp_vocab,
            max_sentences=100_000, model_type="bpe"))
        kinds = {f"HF BPE {args.hf_vocab}": ("HuggingFaceTokenizer", hf),
                 f"SP BPE {args.sp_vocab}": ("SentencePieceTokenizer", sp)}
        flags = {name: ["--tokenizer-type", kind, "--tokenizer-model", model]
                 for name, (kind, model) in kinds.items()}
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f]
        encoders = {name: library_encoder(*kind) for name, kind in kinds.items()}
        print(f"corpus: {docs} documents, {nbytes / 1e6:.1f} MB; cores: {os.cpu_count()}; "
              f"load average before: {load()}")

        encode_s = {name: [] for name in kinds}
        encode_cpu = {name: [] for name in kinds}
        floor = {(name, w): [] for name in kinds for w in args.workers}
        wall = {(name, w): [] for name in kinds for w in args.workers}
        cpu = {(name, w): [] for name in kinds for w in args.workers}
        outputs = {name: [] for name in kinds}
        for _ in range(args.repeats):  # interleaved: a busy spell hits every configuration
            for name in kinds:
                seconds, cpu_s = time_encode(encoders[name], texts)
                encode_s[name].append(seconds)
                encode_cpu[name].append(cpu_s)
                for w in args.workers:
                    floor[name, w].append(encode_s[name][-1] if w == 1 else
                                          time_parallel_encode(*kinds[name], texts, w))
                    out = os.path.join(work, f"out{len(outputs[name])}_{kinds[name][0]}")
                    seconds, cpu_s = run_tool(["--input", corpus, "--output-prefix", out,
                                               *flags[name], "--workers", str(w),
                                               "--append-eod", "--log-interval", "1000000000"])
                    wall[name, w].append(seconds)
                    outputs[name].append(out + "_text_document")
                    cpu[name, w].append(cpu_s)
        del texts

        for name in kinds:
            first, *others = outputs[name]
            for prefix in others:
                for ext in (".bin", ".idx"):
                    if not filecmp.cmp(first + ext, prefix + ext, shallow=False):
                        print(f"MISMATCH: {prefix}{ext} differs from {first}{ext}")
                        return 1
        print(f"outputs: byte-identical across workers and repeats; median of {args.repeats} "
              f"(min-max)")
        print(f"{'tokenizer':<14}{'workers':>8}  {'limit s':<20}{'tool wall s':<20}"
              f"{'ratio':<22}{'floor s':<20}{'tool / floor':<14}{'tool CPU s (x encode CPU)'}")
        for name in kinds:
            for w in args.workers:
                limits = [s / w for s in encode_s[name]]
                ratios = [t / statistics.median(limits) for t in wall[name, w]]
                to_floor = statistics.median(wall[name, w]) / statistics.median(floor[name, w])
                extra_cpu = statistics.median(cpu[name, w]) / statistics.median(encode_cpu[name])
                print(f"{name:<14}{w:>8}  {spread(limits):<20}{spread(wall[name, w]):<20}"
                      f"{spread(ratios) + 'x':<22}{spread(floor[name, w]):<20}"
                      f"{f'{to_floor:.2f}x':<14}{spread(cpu[name, w])} ({extra_cpu:.2f}x)")
        print(f"load average after: {load()}")
        startup(work, {"ByteTokenizer": ["--tokenizer-type", "ByteTokenizer"], **flags})
        if args.memory_scale > 1:
            memory_check(work, corpus, nbytes, args.memory_scale, next(iter(flags.values())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
