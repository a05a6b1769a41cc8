"""Results cached per (model, task, limit): a re-run with one more task evaluates that task.

An entry is one JSON file named by the SHA-256 of its key, which holds every input that changes
the numbers: the model's identity (the ``*_identity`` functions here), the task and a digest of
its config and local files, the limit, the few-shot count, the dtype and the versions of lm-eval
and transformers (:func:`megatron_jreg.downstream.evaluate.evaluate_model` builds it). A run
holds the locks of the entries it evaluates (:meth:`ResultCache.writing`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Optional

from megatron_jreg.atomic_write import write_text_atomic
from megatron_jreg.checkpoint.manifest import MANIFEST
from megatron_jreg.data.tokenizers.build import file_sha256
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import output_locks

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HASHED_BYTES = 256 << 20  # a larger non-weight file is keyed by size and mtime


def file_key(path: str):
    st = os.stat(path)
    if st.st_size > HASHED_BYTES:
        return [st.st_size, st.st_mtime_ns]
    return file_sha256(path)


def hf_model_identity(model_dir: str) -> Dict[str, object]:
    """A Hugging Face directory (or a cached hub id's snapshot): its path, the content of every
    file that is not a weight file and the size and mtime of each weight file."""
    model_dir = os.path.realpath(model_dir)
    weights, files = {}, {}
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            st = os.stat(path)
            weights[name] = [st.st_size, st.st_mtime_ns]
        else:  # config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja, ...
            files[name] = file_key(path)
    return {"hf_model": model_dir, "files": files, "weights": weights}


def _path_key(path: str):
    """A tokenizer file by its content; a directory (vocab.json and merges.txt) by each file's."""
    if os.path.isdir(path):
        return {name: file_key(os.path.join(path, name)) for name in sorted(os.listdir(path))
                if os.path.isfile(os.path.join(path, name))}
    return file_key(path) if os.path.isfile(path) else None


def tokenizer_files_identity(data, tokenizer_model: Optional[str] = None) -> Dict[str, object]:
    """The content of the tokenizer files a run config's data section names (the export
    reads them from there, so a retrained tokenizer at the same path changes the numbers);
    ``tokenizer_model`` (``--tokenizer-model``), which the export reads instead, replaces them."""
    out: Dict[str, object] = {"type": data.tokenizer_type}
    if tokenizer_model is not None:
        out["override"] = _path_key(tokenizer_model)
        return out
    for attr in ("tokenizer_model", "vocab_file", "merge_file"):
        path = getattr(data, attr, None)
        if path:
            out[attr] = _path_key(path)
    return out


def gguf_identity(path: str) -> Dict[str, object]:
    """A GGUF file by its path, size and mtime (hashing gigabytes on every run would cost
    more than the tasks the cache saves)."""
    path = os.path.realpath(path)
    st = os.stat(path)
    return {"gguf": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def checkpoint_identity(iteration_dir: str, root: str, iteration: int, data=None,
                        tokenizer_model: Optional[str] = None) -> Dict[str, object]:
    """``data``: the run config's data section, whose tokenizer files are keyed too (or the
    ``tokenizer_model`` given in their place)."""
    manifest = os.path.join(iteration_dir, MANIFEST)
    return {"checkpoint": os.path.realpath(root), "iteration": iteration,
            "manifest": file_sha256(manifest) if os.path.isfile(manifest) else None,
            "tokenizer": None if data is None else tokenizer_files_identity(data, tokenizer_model)}


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
        # the device, the device map and the batch size are not in ``settings``: they change
        # the numbers only by rounding
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

    def writing(self, entries: Dict[str, Dict[str, object]]):
        """Hold the lock of each entry ({what: key}) for the block; OutputBusy (one line,
        exit 2) when another run is evaluating one of them."""
        if self.directory is None:
            return output_locks([])
        return output_locks([(f"--cache-dir entry of {what}:", self._path(key))
                             for what, key in entries.items()],
                            fix="wait for it to end (its results are then read from the cache) "
                            "or pass --no-cache")

    def put(self, key: Dict[str, object], result: dict) -> None:
        if self.directory is None:
            return
        text = json.dumps({"key": key, "result": result}, sort_keys=True, default=str)
        write_text_atomic(self._path(key), text)
