"""A run reads the checkpoint it starts from once: counted with a Python audit hook (every
``open``: builtins, io and os) in the trainer's own process, for a resume (``--load``) and
for a start from ``--pretrained-checkpoint --use-checkpoint-args`` (read at parse time, then
loaded). ``common.pt`` and ``.metadata`` are opened once each; the shards are opened by the
checksum pass and by the load."""

import json
import os
import subprocess
import sys

import pytest

from checkpoint_runs import ITERS, REPO, run_env

from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir

HOOK = """
import atexit, json, os, runpy, sys
watched, opened = os.path.realpath(sys.argv[1]), []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path.startswith(watched + os.sep):
            opened.append(os.path.relpath(path, watched))
sys.addaudithook(hook)
atexit.register(lambda: json.dump(opened, open(sys.argv[2], "w")))
sys.argv = ["megatron_jreg.train"] + sys.argv[3:]
try:
    runpy.run_module("megatron_jreg.train", run_name="__main__")
except SystemExit as exit:
    code = exit.code
else:
    code = 0
atexit._run_exitfuncs()
os._exit(code or 0)
"""


def _opens(tmp_path, watched, argv):
    log = tmp_path / "opens.json"
    proc = subprocess.run([sys.executable, "-c", HOOK, str(watched), str(log)] + [str(a) for a in argv],
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    opened = json.load(open(log))
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
                                     "train-iters": ITERS + 1, "lr-decay-iters": ITERS + 1})
    else:
        argv = _flags(checkpoint, **{"pretrained-checkpoint": checkpoint,
                                     "use-checkpoint-args": True, "train-iters": 1})
    counts, proc = _opens(tmp_path, path, argv)
    assert "iteration" in proc.stdout  # it trained a step
    assert counts.get("common.pt") == 1 and counts.get(".metadata") == 1, counts
    assert counts.get("run_config.yaml") == 1, counts
    shards = [n for n in os.listdir(path) if n.endswith(".distcp")]
    assert shards and all(counts.get(n, 0) >= 1 for n in shards), counts
