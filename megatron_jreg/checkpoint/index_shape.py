"""Whether what a ``.metadata`` unpickled into is dist-checkpointing's index as its readers
take it (:func:`check_index`, called by the trusted open right after
``safe_pickle.read_metadata``): the root a ``Metadata``, its fields of the types torch's
dataclasses declare, every chunk inside its tensor and backed by a storage record."""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_jreg.checkpoint.safe_pickle import damaged


def check_index(metadata, file: str) -> None:
    """Refuse as damaged (one line) a ``metadata`` read from ``file`` by
    :func:`read_metadata` that is not dist-checkpointing's index as its readers take it."""
    try:
        problem = _index_problem(metadata)
    except Exception as err:  # an object the checks could not even look at
        problem = f"{type(err).__name__} while checking it"
    if problem:
        raise damaged(file, problem)


# Everything below checks the shape of what a .metadata unpickled into: every reader
# (megatron-core, torch DCP, the checks here) takes its fields as torch's dataclasses
# declare them (torch/distributed/checkpoint/metadata.py), so a root that is a list, or a
# Metadata built with state_dict_metadata=5, is refused here rather than as an
# AttributeError wherever it is first used. A message names types, never a repr (a crafted
# value may nest a million deep).
_MISSING = object()
_PROPERTIES = {"dtype": torch.dtype, "layout": torch.layout, "requires_grad": bool,
               "memory_format": torch.memory_format, "pin_memory": bool}


def _kind(value) -> str:
    """``value``'s type in words (``a list``, ``an int``, ``None``, ``missing``)."""
    if value is _MISSING:
        return "missing"
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _name(key: str) -> str:
    return repr(key) if len(key) <= 80 else repr(key[:77]) + "..."


def _is_shape(value) -> bool:
    return type(value) is torch.Size and all(type(d) is int and d >= 0 for d in value)


def _dims(shape) -> str:
    dims = [str(d) for d in list(shape)[:8]]
    return f"[{', '.join(dims)}{', ...' if len(shape) > 8 else ''}]"


def _strings(value, allow_none: bool = True) -> bool:
    return (value is None and allow_none) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))


def _index_problem(meta) -> Optional[str]:
    """What is wrong with ``meta`` as a dist-checkpointing ``Metadata`` (None: nothing)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if type(meta) is not Metadata:
        return f"its root is {_kind(meta)}, not dist-checkpointing's Metadata"
    entries = getattr(meta, "state_dict_metadata", _MISSING)
    if not isinstance(entries, dict):
        return f"its state_dict_metadata is {_kind(entries)}, not a dict"
    storage = getattr(meta, "storage_data", _MISSING)
    if storage is not None and not isinstance(storage, dict):
        return f"its storage_data is {_kind(storage)}, not a dict or None"
    problem = _storage_problem(storage or {})
    for key, entry in entries.items():
        if problem:
            break
        problem = _entry_problem(key, entry, storage)
    return problem or _extras_problem(meta)


def _entry_problem(key, entry, storage) -> Optional[str]:
    """What is wrong with ``entries[key]``: a tensor's record (its properties, size and
    chunks, each chunk inside the size) or a byte entry's, each with its storage record
    where ``storage`` lists them."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not isinstance(key, str):
        return f"its state_dict_metadata has a key that is {_kind(key)}, not a name"
    where = f"its state_dict_metadata[{_name(key)}]"
    if type(entry) is BytesStorageMetadata:
        if storage is not None and MetadataIndex(key) not in storage:
            return f"{where} is a byte entry with no storage record"
        return None
    if type(entry) is not TensorStorageMetadata:
        return f"{where} is {_kind(entry)}, not TensorStorageMetadata or BytesStorageMetadata"
    props = getattr(entry, "properties", _MISSING)
    if type(props) is not TensorProperties:
        return f"{where}.properties is {_kind(props)}, not TensorProperties"
    held = vars(props)
    if set(held) != set(_PROPERTIES):
        return f"{where}.properties holds other fields than TensorProperties'"
    for field, kind in _PROPERTIES.items():
        if not isinstance(held[field], kind):
            return f"{where}.properties.{field} is {_kind(held[field])}, not a {kind.__name__}"
    size = getattr(entry, "size", _MISSING)
    if type(size) is not torch.Size:
        return f"{where}.size is {_kind(size)}, not a torch.Size"
    if not _is_shape(size):
        return f"{where}.size {_dims(size)} has a dimension below 0"
    chunks = getattr(entry, "chunks", _MISSING)
    if not isinstance(chunks, list) or not chunks:
        return f"{where}.chunks is {_kind(chunks) if chunks else 'empty'}, not a list of its chunks"
    for i, chunk in enumerate(chunks):
        if type(chunk) is not ChunkStorageMetadata:
            return f"{where}.chunks[{i}] is {_kind(chunk)}, not ChunkStorageMetadata"
        offsets, sizes = getattr(chunk, "offsets", _MISSING), getattr(chunk, "sizes", _MISSING)
        if not (_is_shape(offsets) and _is_shape(sizes)
                and len(offsets) == len(sizes) == len(size)):
            return (f"{where}.chunks[{i}] has offsets and sizes that are not torch.Sizes of "
                    f"the tensor's {len(size)} dimensions")
        if any(o + n > d for o, n, d in zip(offsets, sizes, size)):
            return (f"{where}.chunks[{i}] (offsets {_dims(offsets)}, sizes {_dims(sizes)}) "
                    f"reaches past the tensor's size {_dims(size)}")
        if storage is not None and MetadataIndex(key, offsets) not in storage:
            return f"{where}.chunks[{i}] has no storage record"
    return None


def _storage_problem(storage: dict) -> Optional[str]:
    """What is wrong with ``storage_data``: {MetadataIndex: _StorageInfo} with a file name,
    an offset and a length in it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for index, info in storage.items():
        if type(index) is not MetadataIndex or not isinstance(getattr(index, "fqn", None), str):
            return f"its storage_data has a key that is {_kind(index)}, not a MetadataIndex"
        where = f"its storage_data[{_name(index.fqn)}]"
        offset = getattr(index, "offset", None)
        if offset is not None and not _is_shape(offset):
            return f"{where} has an offset that is {_kind(offset)}, not a torch.Size"
        if type(info) is not _StorageInfo:
            return f"{where} is {_kind(info)}, not dist-checkpointing's _StorageInfo"
        for field in ("offset", "length"):
            value = getattr(info, field, _MISSING)
            if type(value) is not int or value < 0:
                return f"{where}.{field} is {_kind(value)}, not an integer >= 0"
        path = getattr(info, "relative_path", _MISSING)
        if not isinstance(path, str):
            return f"{where}.relative_path is {_kind(path)}, not a file name"
        if not _strings(getattr(info, "transform_descriptors", None)):
            return f"{where}.transform_descriptors is not a list of names"
    return None


def _extras_problem(meta) -> Optional[str]:
    """What is wrong with the rest: ``planner_data`` (DCP's {name: object path}),
    ``storage_meta``, ``version`` and megatron-core's ``all_local_plans``."""
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan

    planner = getattr(meta, "planner_data", None)
    if planner is not None:
        if not isinstance(planner, dict):
            return f"its planner_data is {_kind(planner)}, not a dict or None"
        for key, path in planner.items():
            if not isinstance(key, str) or not isinstance(path, (tuple, list)) \
                    or not all(isinstance(p, (str, int)) for p in path):
                return "its planner_data is not a dict of names to object paths"
    storage_meta = getattr(meta, "storage_meta", None)
    if storage_meta is not None:
        if type(storage_meta) is not StorageMeta:
            return f"its storage_meta is {_kind(storage_meta)}, not StorageMeta or None"
        checkpoint_id = getattr(storage_meta, "checkpoint_id", None)
        if checkpoint_id is not None and not isinstance(checkpoint_id, (str, os.PathLike)):
            return f"its storage_meta.checkpoint_id is {_kind(checkpoint_id)}, not a path"
        for field in ("save_id", "load_id"):
            value = getattr(storage_meta, field, None)
            if value is not None and not isinstance(value, str):
                return f"its storage_meta.{field} is {_kind(value)}, not a string or None"
        if not _strings(getattr(storage_meta, "modules", []), allow_none=False):
            return "its storage_meta.modules is not a list of names"
    version = getattr(meta, "version", None)
    if version is not None and not isinstance(version, str):
        return f"its version is {_kind(version)}, not a string or None"
    plans = vars(meta).get("all_local_plans")
    if plans is not None and not (isinstance(plans, list)
                                  and all(type(p) is SavePlan for p in plans)):
        return "its all_local_plans is not a list of SavePlan"
    return None


# numpy's classes in a random state (np.random.get_state()'s array), also under numpy 1's
# module name, which Megatron-LM's checkpoints from numpy 1 carry; the rest of what a
# random state, a sharded object or the common state holds is torch's own weights_only set
# plus megatron-core's (megatron/core/safe_globals.py, registered when it is imported)
