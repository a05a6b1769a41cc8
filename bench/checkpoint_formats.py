"""Save and load time and size of the checkpoint formats, in one run: the save kinds
(plain: data-parallel rank 0 writes the weights every rank holds; fully parallel: they are
spread over the ranks, --ckpt-fully-parallel-save; async: fully parallel, written in the
background, --async-save --use-persistent-ckpt-worker) times the distributed optimizer's
formats (dp_reshardable, fully_reshardable).

Builds a JREG model of a preset's dimensions (fewer layers, a smaller vocabulary) as the
trainer does (bench/one_device_model.py) on ``--nproc`` ranks (data-parallel, megatron's
distributed optimizer), takes two Adam steps on random tokens, then for each format saves
iteration 1 with the trainer's own ``save_checkpoint`` and loads it back with
``load_checkpoint`` (its checksum check included), plain and fully parallel, checking that
the weights come back equal (the async saves after a first one that starts the worker,
timed apart, as a job's later saves are). Columns: the time the loop is blocked by the
save, the time until the save is whole (the same for synchronous saves), the load times,
the bytes on disk, each against the plain save of the same optimizer format. For the async
saves the loop trains on while the shards are written: the median step time then, against
the median step time without a save, is the cost of the overlap. Prints a markdown table
and a ``RESULT {json}`` line (read by bench/gpu_checks.py).

    python bench/checkpoint_formats.py                       # CPU, 2 gloo ranks
    python bench/checkpoint_formats.py --preset tiny --vocab 512 --seq 64   # seconds
    python bench/checkpoint_formats.py --device cuda --nproc 1 --bf16 --preset 1b --layers 4

It starts its ranks itself (torchrun); ``--dir`` puts the checkpoints elsewhere than a
temporary directory (each is removed once measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the package
sys.path.insert(0, HERE)  # one_device_model

SAVES = ("plain", "fully parallel", "async")
FORMATS = ("dp_reshardable", "fully_reshardable")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks (data-parallel); default 2 on cpu, 1 on cuda (one GPU)")
    parser.add_argument("--preset", default="170m", choices=["tiny", "170m", "1b", "3b"])
    parser.add_argument("--layers", type=int, default=2, help="layers (fewer than the preset's)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size")
    parser.add_argument("--seq", type=int, default=256, help="sequence length of the steps")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--bf16", action="store_true", help="bf16 weights (fp32 main params)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps without a save")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    return parser.parse_args(argv)


def launch(args) -> int:
    """This script under torchrun on ``--nproc`` ranks (rank 0 prints)."""
    nproc = args.nproc or (2 if args.device == "cpu" else 1)
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(HERE), env.get("PYTHONPATH"))
                                        if p)
    if args.device == "cpu":
        env["MEGATRON_JREG_DEVICE"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(nproc), os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.run(cmd, env=env).returncode


def _max(value: float) -> float:
    """The largest of the ranks' values (a save or load lasts as long as its slowest rank)."""
    import torch
    import torch.distributed as dist

    from megatron_jreg.platform.device import collective_device

    t = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    return out, _max(time.perf_counter() - t0)


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(base, n)) for base, _, names in os.walk(path)
               for n in names)


def measure(args) -> dict:
    import one_device_model

    device = one_device_model.start(args.device)
    import torch
    import torch.distributed as dist

    from megatron_jreg.checkpoint import formats
    from megatron_jreg.checkpoint.async_save import AsyncSaver
    from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir, save_checkpoint
    from megatron_jreg.checkpoint.loading import load_checkpoint
    from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
    from megatron_jreg.config.run import OptimConfig
    from megatron_jreg.config.yaml_settings import to_yaml
    from megatron_jreg.model.jreg_layer import JregTracker
    from megatron_jreg.training.optimizer import build_optimizer
    from megatron_jreg.training.step import forward_backward

    model_cfg = ModelConfig.from_preset(args.preset, vocab_size=args.vocab, num_layers=args.layers,
                                        seq_length=args.seq, bf16=args.bf16)
    run_config = to_yaml({"model": model_cfg})  # a read compares it with the saved tensors
    tracker = JregTracker(JregConfig(lam=1.0, alpha=1.0), model_cfg.num_layers)
    config, chunks = one_device_model.build(model_cfg, ParallelConfig(), tracker, device,
                                            float16_module=args.bf16, distributed_optimizer=True)
    optimizer = build_optimizer(chunks, config, model_cfg,
                                OptimConfig(lr=1e-4, use_distributed_optimizer=True))
    config.grad_scale_func = optimizer.scale_loss
    batch = one_device_model.random_batch(args.vocab, args.micro_batch, args.seq, device)

    def step() -> float:
        t0 = time.perf_counter()
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(chunks, [batch], args.seq, args.micro_batch, tracker)
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step(), step()  # Adam's state exists: the optimizer's part of the checkpoint is whole
    plain_step = statistics.median(step() for _ in range(args.steps))
    params = sum(p.numel() for c in chunks for p in c.parameters())
    world = dist.get_world_size()
    root = tempfile.mkdtemp(prefix="ckpt_formats_", dir=args.dir) if dist.get_rank() == 0 else None
    shared = [root]
    dist.broadcast_object_list(shared, src=0)
    root = shared[0]
    saver = AsyncSaver()
    rows = []
    try:
        # the trainer starts the results queue before training and the worker at its first
        # save: both timed apart, so that the rows are the saves of a running job
        _, started = _timed(saver.start)
        first = os.path.join(root, "first")
        _, first_blocked = _timed(lambda: save_checkpoint(
            first, 1, chunks, optimizer, None, run_config, {}, fully_parallel=True,
            background=saver))
        _, first_whole = _timed(lambda: saver.finalize(blocking=True))
        if dist.get_rank() == 0:
            shutil.rmtree(first)
        for fmt in FORMATS:
            for kind in SAVES:
                target = os.path.join(root, f"{kind.replace(' ', '_')}-{fmt}")
                saved = [p.detach().clone() for c in chunks for p in c.parameters()]
                background = saver if kind == "async" else None

                def save(target=target, fmt=fmt, kind=kind, background=background):
                    return save_checkpoint(target, 1, chunks, optimizer, None, run_config, {},
                                           fully_reshardable=fmt == "fully_reshardable",
                                           fully_parallel=kind != "plain", background=background)

                _, blocked = _timed(save)
                t0, during = time.perf_counter(), []
                while background is not None and saver.pending is not None:
                    # the loop trains on while the shards are written (the load below must
                    # still give the weights of the save)
                    during.append(step())
                    saver.finalize(blocking=False)
                whole = blocked + _max(time.perf_counter() - t0)
                size = _bytes(iteration_dir(target, 1)) if dist.get_rank() == 0 else 0
                loads = {}
                for parallel in (False, True):
                    with torch.no_grad():
                        for c in chunks:
                            for p in c.parameters():
                                p.zero_()
                    _, loads[parallel] = _timed(
                        lambda target=target, parallel=parallel: load_checkpoint(
                            formats.read(target), chunks, optimizer, fully_parallel=parallel))
                    back = [p for c in chunks for p in c.parameters()]
                    if not all(torch.equal(a, b) for a, b in zip(back, saved)):
                        raise SystemExit(f"{kind} {fmt}: the loaded weights differ from the saved")
                if dist.get_rank() == 0:
                    shutil.rmtree(target)
                rows.append({"save": kind, "format": fmt, "blocked_s": blocked, "whole_s": whole,
                             "load_s": loads[False], "load_fully_parallel_s": loads[True],
                             "bytes": size, "steps_during_write": len(during),
                             "step_s_during_write": statistics.median(during) if during else None})
    finally:
        saver.close()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    return {"device": args.device, "ranks": world, "preset": args.preset, "layers": args.layers,
            "vocab": args.vocab, "params_per_rank": params, "bf16": args.bf16,
            "step_s": plain_step, "async_start_s": started,
            "first_async_save_s": first_blocked + first_whole, "rows": rows}


def table(result: dict) -> str:
    rows = result["rows"]
    plain = {r["format"]: r for r in rows if r["save"] == "plain"}

    def ratio(r, key):
        base = plain[r["format"]][key]
        return f"{r[key] / base:.2f}x" if base else "-"

    lines = ["| save | optimizer format | blocked s | whole s | load s | fully parallel load s "
             "| MB on disk | blocked / plain | load / plain | size / plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['save']} | {r['format']} | {r['blocked_s']:.2f} | {r['whole_s']:.2f} | "
                     f"{r['load_s']:.2f} | {r['load_fully_parallel_s']:.2f} | "
                     f"{r['bytes'] / 1e6:.1f} | "
                     f"{ratio(r, 'blocked_s')} | {ratio(r, 'load_s')} | {ratio(r, 'bytes')} |")
    overlap = [r for r in rows if r["steps_during_write"]]
    step = result["step_s"]
    for r in overlap:
        lines.append(f"async {r['format']}: {r['steps_during_write']} steps while the shards were "
                     f"written, median {r['step_s_during_write']:.3f} s against {step:.3f} s "
                     f"without a save ({r['step_s_during_write'] / step:.2f}x)")
    lines.append(f"async, once per run: the results queue's process started in "
                 f"{result['async_start_s']:.2f} s (before training), the first save (its worker "
                 f"starting) whole in {result['first_async_save_s']:.2f} s")
    if not overlap:
        lines.append("async: the shards were written before the first step after the save ended "
                     "(no step overlapped the write)")
    return "\n".join(lines)


def main() -> int:
    args = parse()
    if "RANK" not in os.environ:
        return launch(args)
    result = measure(args)
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(f"{result['preset']} x{result['layers']} layers, vocab {result['vocab']}, "
              f"{result['params_per_rank'] / 1e6:.1f}M parameters, "
              f"{'bf16' if result['bf16'] else 'fp32'}, {result['ranks']} {result['device']} "
              f"rank(s) (data-parallel, distributed optimizer)")
        print(table(result))
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
