"""Results cached per (model, task, limit): a re-run with one more task evaluates that task.

An entry is one JSON file named by the SHA-256 of its key. The key holds the model's
identity (a checkpoint: its directory, iteration and the checksum manifest of that
iteration; a Hugging Face directory or a cached hub id's snapshot: its path, config.json and
the size and mtime of each weight file; a GGUF file: its path, size and mtime), the task
and a digest of its resolved config (an edited local YAML is a new task), the limit, the
few-shot count, the dtype and lm-eval's version. The device, the device map and the batch
size are not part of it: they change the numbers only by rounding.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

from megatron_jreg.atomic_write import write_text_atomic
from megatron_jreg.data.tokenizers import file_sha256
from megatron_jreg.errors import InputError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def hf_model_identity(model_dir: str) -> Dict[str, object]:
    model_dir = os.path.realpath(model_dir)
    config = os.path.join(model_dir, "config.json")
    weights = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(model_dir, name))
            weights[name] = [st.st_size, st.st_mtime_ns]
    return {"hf_model": model_dir, "config": file_sha256(config) if os.path.isfile(config) else None,
            "weights": weights}


def gguf_identity(path: str) -> Dict[str, object]:
    """A GGUF file by its path, size and mtime (hashing gigabytes on every run would cost
    more than the tasks the cache saves)."""
    path = os.path.realpath(path)
    st = os.stat(path)
    return {"gguf": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def checkpoint_identity(iteration_dir: str, root: str, iteration: int) -> Dict[str, object]:
    from megatron_jreg.checkpoint.manifest import MANIFEST

    manifest = os.path.join(iteration_dir, MANIFEST)
    return {"checkpoint": os.path.realpath(root), "iteration": iteration,
            "manifest": file_sha256(manifest) if os.path.isfile(manifest) else None}


class ResultCache:
    """get/put of one task's lm-eval metrics; ``directory`` None caches nothing."""

    def __init__(self, directory: Optional[str]):
        self.directory = directory
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                raise InputError(f"--cache-dir {directory}: cannot create it ({err.strerror}); "
                                 "give a writable directory or --no-cache") from None

    @staticmethod
    def key(model: Dict[str, object], **settings) -> Dict[str, object]:
        return {"model": model, **settings}

    def _path(self, key: Dict[str, object]) -> str:
        text = json.dumps(key, sort_keys=True, default=str)
        return os.path.join(self.directory, hashlib.sha256(text.encode()).hexdigest() + ".json")

    def get(self, key: Dict[str, object]) -> Optional[dict]:
        if self.directory is None:
            return None
        try:
            with open(self._path(key)) as f:
                entry = json.load(f)
        except (OSError, ValueError):  # absent, or unreadable: evaluate again
            return None
        same = json.loads(json.dumps(key, sort_keys=True, default=str))
        return entry.get("result") if entry.get("key") == same else None

    def put(self, key: Dict[str, object], result: dict) -> None:
        if self.directory is None:
            return
        text = json.dumps({"key": key, "result": result}, sort_keys=True, default=str)
        write_text_atomic(self._path(key), text)
