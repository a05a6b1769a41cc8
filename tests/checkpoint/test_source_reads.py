"""A run reads the checkpoint it starts from once: counted with a Python audit hook (every
``open``: builtins, io and os) in the trainer's own process, for a resume (``--load``) and
for a start from ``--pretrained-checkpoint --use-checkpoint-args`` (read at parse time, then
loaded). ``common.pt`` and ``.metadata`` are opened once each (read into memory, checked
and unpickled from those bytes); the other files by the checksum pass and by their reader."""

import os
import subprocess
import sys

import pytest
from checkpoint_runs import ITERS, REPO, run_env

from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir

HOOK = """
import os, runpy, sys
watched = os.path.realpath(sys.argv[1])
log = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # before the hook
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(watched + os.sep):
            os.write(log, (os.path.relpath(path, watched) + "\\n").encode())
sys.addaudithook(hook)
sys.argv = ["megatron_jreg.train"] + sys.argv[3:]
runpy.run_module("megatron_jreg.train", run_name="__main__")
"""


def _opens(tmp_path, watched, argv):
    log = tmp_path / "opens.json"
    proc = subprocess.run([sys.executable, "-c", HOOK, str(watched), str(log)]
                          + [str(a) for a in argv],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    opened = open(log).read().splitlines() if log.exists() else []
    return {name: opened.count(name) for name in set(opened)}, proc


def _flags(checkpoint, **extra):
    data = os.path.join(os.path.dirname(str(checkpoint)), "demo_text_document")
    flags = {"seq-length": 64, "data-path": data, "tokenizer-type": "ByteTokenizer",
             "micro-batch-size": 4, "global-batch-size": 8, "eval-interval": 0, "lr": 3e-3,
             "lr-warmup-iters": 1, "seed": 1234, "log-interval": 1}
    flags.update(extra)
    argv = []
    for key, value in flags.items():
        argv += [f"--{key}"] if value is True else [f"--{key}", value]
    return argv


@pytest.mark.parametrize("start", ["resume", "pretrained_use_checkpoint_args"])
def test_the_source_checkpoint_is_read_once(checkpoint, tmp_path, start):
    path = iteration_dir(str(checkpoint), ITERS)
    if start == "resume":
        argv = _flags(checkpoint, **{"model-preset": "tiny", "vocab-size": 512, "load": checkpoint,
                                     "train-iters": ITERS + 1,
                                     "use-checkpoint-opt-param-scheduler": True})
    else:
        argv = _flags(checkpoint, **{"pretrained-checkpoint": checkpoint,
                                     "use-checkpoint-args": True, "train-iters": 2,
                                     "lr-warmup-iters": 0})
    counts, proc = _opens(tmp_path, path, argv)
    assert "iteration" in proc.stdout  # it trained a step
    assert counts.get("common.pt") == 1 and counts.get(".metadata") == 1, counts
    # the descriptor reads the run config; the checksum pass hashes it
    assert counts.get("run_config.yaml") == 2, counts
    shards = [n for n in os.listdir(path) if n.endswith(".distcp")]
    assert shards and all(counts.get(n, 0) >= 1 for n in shards), counts
