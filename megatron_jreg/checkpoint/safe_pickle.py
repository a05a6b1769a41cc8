"""The pickles of a checkpoint are read as data, never as code.

A torch_dist iteration directory holds four kinds of pickle, and the libraries that read
them would run whatever a crafted one names:

- ``.metadata``, dist-checkpointing's index of the shards: torch's
  ``FileSystemReader.read_metadata`` reads it with plain ``pickle.load``;
- the byte entries inside the ``.distcp`` shards (megatron-core's sharded objects: the
  random state, the distributed optimizer's parameter groups, layers' extra state): torch's
  ``DefaultLoadPlanner.load_bytes`` reads them with ``torch.load(weights_only=False)``;
- ``common.pt``, megatron-core's common state: ``torch.load`` with torch's default, which is
  ``weights_only`` unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set;
- ``rng/rank_NNNNN.pt``, the random state of this project's earlier versions.

:func:`check_metadata`, :func:`check_byte_entries` and :func:`check_common` read the
first three here, each before the dependency that reads it (the readers of this package
call them: ``loading``, ``dist_checkpoint.saved_embedding_rows``, ``megatron_lm_args.
read_common_state``, the trainer's schedule look-up): ``.metadata`` with an unpickler that
imports only the classes dist-checkpointing's index is made of (:data:`METADATA_GLOBALS`:
what torch 2.13 and megatron-core 0.16.1 write, traced from the saves of every checkpoint
kind the tests make), the others with ``torch.load(weights_only=True)`` and the numpy
classes of a random state beside megatron-core's own allow-list (which it registers with
torch when imported). A file that names anything else is refused in one line
(:class:`UnsafeCheckpointError`) and nothing in it runs; a file these readers cannot read
stops the load as damaged (a reader that stops early cannot vouch for the rest of the
file). A file that passes is then read by the dependency as before: its reader meets only
the classes allowed here. :func:`load_torch_file` reads the earlier versions' random state
files the same way.
"""

from __future__ import annotations

import _compat_pickle
import importlib
import io
import os
import pickle
import re
import sys
from typing import Dict, Tuple

import numpy as np
import torch

from megatron_jreg.errors import CheckpointError

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"

# What torch_dist's .metadata is made of: torch.distributed.checkpoint's dataclasses and
# enums (the index, the storage records, the save plans megatron-core keeps in it), torch's
# Size, and torch's dtypes and layouts (:func:`_allowed_in_metadata`). Each is data: built
# without running anything but its own constructor or enum lookup.
METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata",
        "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout pickles as this call on its name
    ("collections", "OrderedDict"),
})


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file whose unpickling would import something outside its allow-list."""


def _allowed_in_metadata(module: str, name: str) -> bool:
    if (module, name) in METADATA_GLOBALS:
        return True
    # a dtype or layout pickles as the attribute of torch that holds it (torch.float32);
    # vars(), not getattr(): torch's module __getattr__ imports submodules on a miss
    return module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.layout))


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that imports only what a dist-checkpointing index holds. Every
    import of a pickle goes through ``find_class`` (GLOBAL, STACK_GLOBAL, INST, OBJ and the
    copyreg extension codes); a REDUCE or NEWOBJ can only call what it returned."""

    def find_class(self, module: str, name: str):
        # protocols 0-2 name Python 2's modules, which pickle maps to Python 3's: judge
        # (and name) what it would import
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if _allowed_in_metadata(module, name):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid):  # torch's .metadata has none
        raise pickle.UnpicklingError("a persistent id, which a .metadata never holds")


def refusal(file: str, name: str, what: str) -> UnsafeCheckpointError:
    """The one-line refusal of ``file`` (``what``: the kind of file, as "which WHAT never
    holds" reads) for importing ``name``."""
    return UnsafeCheckpointError(
        f"{file}: refused to load: unpickling it would import {name}, which {what} never "
        "holds, and could run code (a checkpoint runs no code here); rebuild the checkpoint "
        "with a tool you trust")


def _damaged(file: str, err: BaseException, step_flag: str) -> CheckpointError:
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return CheckpointError(
        f"cannot read checkpoint file {file} ({type(err).__name__}: {first}); it is damaged "
        f"or not dist-checkpointing's: load an earlier one with {step_flag}")


def read_metadata(file: str, step_flag: str = "--ckpt-step"):
    """dist-checkpointing's ``Metadata`` from ``file`` (a ``.metadata``), read with only
    :data:`METADATA_GLOBALS` importable."""
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except _Refused as err:
        raise refusal(file, err.name, "dist-checkpointing's index (.metadata)") from None
    except Exception as err:  # a truncated or foreign file; RecursionError included
        raise _damaged(file, err, step_flag) from None


# numpy's classes in a random state (np.random.get_state()'s array), also under numpy 1's
# module name, which Megatron-LM's checkpoints from numpy 1 carry; the rest of what a
# random state, a sharded object or the common state holds is torch's own weights_only set
# plus megatron-core's (megatron/core/safe_globals.py, registered when it is imported)
def torch_file_globals() -> list:
    """The numpy classes above, looked up when a file is read (numpy 2 names its core
    ``numpy._core``, numpy 1 ``numpy.core``; nothing of numpy's runs at import)."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"),
            np.ndarray, np.dtype, type(np.dtype(np.uint32))]
# torch names the import it refused as "GLOBAL module.name" (in two wordings)
_GLOBAL_NAME = re.compile(r"GLOBAL ([\w.]+)")


def _weights_only_reason(text: str) -> str:
    """The specific line of torch's weights_only error (between its fixed header and its
    pointer to the documentation)."""
    parts = [p.strip() for p in text.split("\n\n") if p.strip()]
    middle = parts[1:-1] or parts[-1:] or ["unpickling failed"]
    return middle[0].splitlines()[0].replace("WeightsUnpickler error: ", "")[:200]


def load_torch_file(source, file: str, what: str):
    """``torch.load(source, weights_only=True)`` with :func:`torch_file_globals` allowed
    (added for good, as megatron-core adds its own: a ``safe_globals`` block would take
    megatron-core's away again at its end). A refusal raises :class:`UnsafeCheckpointError`
    naming ``file`` (``what``: as :func:`refusal`); a damaged file, torch's own error."""
    torch.serialization.add_safe_globals(torch_file_globals())
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        reason = _weights_only_reason(str(err))
        found = _GLOBAL_NAME.search(reason)
        if found:
            raise refusal(file, found.group(1), what) from None
        raise UnsafeCheckpointError(
            f"{file}: refused to load: unpickling it would do what {what} never does "
            f"({reason}), and could run code (a checkpoint runs no code here); rebuild the "
            "checkpoint with a tool you trust") from None


def _byte_entries(metadata) -> Dict[str, Tuple[str, object]]:
    """{key: (shard file name, storage record)} of the byte entries ``metadata`` lists."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    entries = {}
    storage = getattr(metadata, "storage_data", None) or {}
    for key, kind in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        if isinstance(kind, BytesStorageMetadata):
            info = storage.get(MetadataIndex(key))
            if info is not None:
                entries[key] = (str(info.relative_path), info)
    return entries


def check_byte_entries(path: str, step_flag: str = "--ckpt-step") -> None:
    """Each byte entry of iteration directory ``path``'s shards (the sharded objects
    dist-checkpointing's load unpickles), cut from its file as torch's reader cuts it and
    read with :func:`load_torch_file`. Once per process while the files stay the same."""
    from torch.distributed.checkpoint.filesystem import _StorageReaderTransforms
    from torch.distributed.checkpoint.utils import _create_file_view

    metadata = check_metadata(path, step_flag)
    if metadata is None:
        return
    by_file: Dict[str, list] = {}
    for key, (name, info) in _byte_entries(metadata).items():
        by_file.setdefault(name, []).append((key, info))
    signature = ("entries",) + tuple(_signature(os.path.join(path, n)) for n in
                                     (METADATA_FILE, *sorted(by_file)))
    if signature in _checked:
        return
    transforms = _StorageReaderTransforms()
    for name, items in sorted(by_file.items()):
        shard = os.path.join(path, name)
        try:
            stream = open(shard, "rb")
        except OSError as err:
            raise _damaged(shard, err, step_flag) from None
        with stream:
            for key, info in items:
                where = f"{shard} (entry {key})"
                try:
                    view = _create_file_view(stream, info.offset, info.length)
                    data = transforms.transform_load_stream(
                        None, info.transform_descriptors or (), view).read(-1)
                    load_torch_file(io.BytesIO(data), where, "a checkpoint's sharded object")
                except UnsafeCheckpointError:
                    raise
                except Exception as err:
                    raise _damaged(where, err, step_flag) from None
    _checked.add(signature)


def _signature(file: str) -> Tuple:
    try:
        st = os.stat(file)
    except OSError:
        return (os.path.realpath(file), None)
    return (os.path.realpath(file), st.st_size, st.st_mtime_ns, st.st_ino)


_checked = set()  # signatures of the files (and sets of files) that passed


def check_metadata(path: str, step_flag: str = "--ckpt-step"):
    """Iteration directory ``path``'s ``.metadata`` read by :func:`read_metadata` (the
    ``Metadata``), or None when it has none (the caller's reader names that). Raises
    :class:`UnsafeCheckpointError`, or CheckpointError for a file that cannot be read
    (``step_flag`` picks another iteration)."""
    file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(file):
        return None
    signature = ("metadata",) + _signature(file)
    cached = _metadata_cache.get(signature)
    if cached is None:
        cached = _metadata_cache[signature] = read_metadata(file, step_flag)
    return cached


_metadata_cache: Dict[Tuple, object] = {}


def check_common(path: str, step_flag: str = "--ckpt-step") -> None:
    """Iteration directory ``path``'s ``common.pt`` read by :func:`load_torch_file` with
    megatron-core's allow-list (what its own load allows; this one holds whatever
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` says). Nothing when it has none."""
    file = os.path.join(path, COMMON_FILE)
    if not os.path.isfile(file):
        return
    signature = ("common",) + _signature(file)
    if signature in _checked:
        return
    what = "megatron-core's common state (common.pt)"
    try:
        try:
            load_torch_file(file, file, what)
        except UnsafeCheckpointError as refused:
            # Megatron-LM's args hold argparse's Namespace and megatron-core's enums, which
            # megatron-core allows once it is imported: read again with them
            if "megatron.core" in sys.modules:
                raise
            try:
                importlib.import_module("megatron.core")
            except ImportError:  # without it nothing but this package reads the file
                raise refused from None
            load_torch_file(file, file, what)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise _damaged(file, err, step_flag) from None
    _checked.add(signature)


def check_iteration(path: str, step_flag: str = "--ckpt-step") -> None:
    """:func:`check_metadata`, :func:`check_common` and :func:`check_byte_entries`: every
    pickle dist-checkpointing's load of ``path`` reads."""
    check_metadata(path, step_flag)
    check_common(path, step_flag)
    check_byte_entries(path, step_flag)
