"""Cost of the checkpoint manifest (per-file CRC-32) on a 1B-size checkpoint's bytes.

Writes files shaped like one save of the ``1b`` preset (bf16 weights, fp32 main params,
two fp32 Adam moments: 14 bytes per parameter, split into one shard per rank as
dist-checkpointing writes them), then times, in one run:
  write     writing those bytes (with fsync), the save's own I/O;
  manifest  write_manifest (hash every file, what a save adds);
  verify    verify_manifest (what a load adds), from the page cache and, where the
            process may drop caches (root), from disk.
Prints seconds, GB/s and seconds per GB, and the manifest's share of the save's I/O.

    python bench/checkpoint_checksum.py                # the 1b preset's bytes
    python bench/checkpoint_checksum.py --gb 2 --dir /scratch
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_jreg.checkpoint.manifest import verify_manifest, write_manifest  # noqa: E402
from megatron_jreg.config.model import ModelConfig  # noqa: E402

BYTES_PER_PARAM = 2 + 4 + 4 + 4  # bf16 weight, fp32 main param, Adam exp_avg and exp_avg_sq


def preset_params(preset: str, vocab: int) -> int:
    m = ModelConfig.from_preset(preset, vocab_size=vocab)
    h, layers = m.hidden_size, m.num_layers
    kv = m.query_groups * (h // m.num_attention_heads)
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * m.ffn_size + 2 * h
    return layers * per_layer + 2 * h * m.padded_vocab_size() + h


def write_shards(directory: str, total: int, shards: int) -> float:
    block = os.urandom(64 << 20)
    t0 = time.perf_counter()
    for i in range(shards):
        left = total // shards
        with open(os.path.join(directory, f"__{i}_0.distcp"), "wb") as f:
            while left > 0:
                n = min(left, len(block))
                f.write(block[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1b", help="model preset whose checkpoint size to use")
    p.add_argument("--vocab-size", type=int, default=32000, help="vocabulary of that model")
    p.add_argument("--gb", type=float, default=None, help="bytes to write instead (GB)")
    p.add_argument("--shards", type=int, default=8, help="files, as ranks of the save")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = p.parse_args()
    params = preset_params(args.preset, args.vocab_size)
    total = int(args.gb * 1e9) if args.gb else params * BYTES_PER_PARAM
    gb = total / 1e9
    root = tempfile.mkdtemp(prefix="ckpt_checksum_", dir=args.dir)
    try:
        print(f"{gb:.2f} GB in {args.shards} files"
              + ("" if args.gb else f" (the {args.preset} preset: {params / 1e9:.2f}B parameters "
                                    f"x {BYTES_PER_PARAM} bytes)") + f" under {root}", flush=True)
        rows = [("write (fsync)", write_shards(root, total, args.shards))]
        t0 = time.perf_counter()
        write_manifest(root)
        rows.append(("manifest (hash all)", time.perf_counter() - t0))
        t0 = time.perf_counter()
        problem = verify_manifest(root)
        rows.append(("verify, page cache", time.perf_counter() - t0))
        assert problem is None, problem
        if drop_caches():
            t0 = time.perf_counter()
            verify_manifest(root)
            rows.append(("verify, from disk", time.perf_counter() - t0))
        print(f"{'step':22s} {'seconds':>8s} {'GB/s':>7s} {'s/GB':>7s}")
        for name, sec in rows:
            print(f"{name:22s} {sec:8.2f} {gb / sec:7.2f} {sec / gb:7.3f}")
        write_s = rows[0][1]
        print(f"summary: the manifest adds {rows[1][1]:.1f}s to a {gb:.1f} GB save "
              f"({100 * rows[1][1] / write_s:.0f}% of writing it), {rows[1][1] / gb:.3f} s/GB on "
              f"{os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
