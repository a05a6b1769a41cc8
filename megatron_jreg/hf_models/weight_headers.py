"""The shape of every tensor a Hugging Face model's weight files list, read from their
headers alone (no tensor data), for :mod:`megatron_jreg.hf_models.claims`:

- ``model.safetensors`` and the shards of ``model.safetensors.index.json``: the JSON
  header at the start of each file (8 bytes of length, then the JSON);
- ``pytorch_model.bin`` (and its index): unpickled by ``torch.load`` onto the meta
  device with ``weights_only``, which lists shapes without reading a storage.

A file that cannot be read so is one InputError naming it.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from megatron_jreg.errors import InputError

Shape = Tuple[int, ...]

# bytes of a safetensors JSON header: the safetensors library's own bound
_MAX_HEADER = 100_000_000
_SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def shown(value) -> str:
    """A config value as the messages show it: null for None, the repr otherwise, cut
    short (a 400-digit integer is still one line)."""
    text = "null" if value is None else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unreadable(file: str, why: str) -> InputError:
    return InputError(f"{file}: {why}; the weight file is damaged or not what its name says, "
                      "replace it")


def first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def safetensors_shapes(file: str) -> Dict[str, Shape]:
    """The shape of every tensor ``file`` lists, from its JSON header alone."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little")
            text = f.read(length) if len(prefix) == 8 and length <= min(size - 8, _MAX_HEADER) \
                else None
    except OSError as err:
        raise InputError(f"{file}: cannot read it ({first_line(err)}); check the file") from None
    if len(prefix) < 8:
        raise _unreadable(file, f"{size} bytes, shorter than a safetensors header")
    if text is None:
        raise _unreadable(file, f"its header claims {length} bytes, the file holds "
                          f"{size - 8} after the length")
    try:
        header = json.loads(text)
    except ValueError as err:  # not JSON, not UTF-8
        raise _unreadable(file, f"its header is not JSON ({first_line(err)})") from None
    if not isinstance(header, dict):
        raise _unreadable(file, "its header is not a JSON object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise _unreadable(file, f"its header lists {name} with shape {shown(shape)}, not a "
                              "list of sizes")
        shapes[name] = tuple(shape)
    return shapes


def pickle_shapes(file: str) -> Dict[str, Shape]:
    """The shape of every tensor of a ``torch.save``d state dict, loaded onto the meta
    device (``weights_only``): the pickle is read, no storage is."""
    import torch

    try:
        state = torch.load(file, map_location="meta", weights_only=True)
    except Exception as err:  # noqa: BLE001 - anything torch.load raises is a bad file
        raise _unreadable(file, f"torch.load cannot list its tensors ({first_line(err)})"
                          ) from None
    if not isinstance(state, dict):
        raise _unreadable(file, f"it holds a {type(state).__name__}, not a state dict")
    return {str(name): tuple(t.shape) for name, t in state.items() if isinstance(t, torch.Tensor)}


def _index_shards(directory: str, index: str) -> List[str]:
    """The shard files ``index`` (a ``*.index.json``) names, each in ``directory``."""
    path = os.path.join(directory, index)
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as err:
        raise InputError(f"{path}: cannot read its weight_map ({first_line(err)}); fix or "
                         "replace the file") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{path}: weight_map is not an object of tensor names to shard files; "
                         "fix or replace the file")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if os.path.basename(shard) != shard or shard in ("", ".", ".."):
            raise InputError(f"{path}: names shard {shard!r}, which is not a file name in "
                             "the model's directory; fix the index")
        if not os.path.isfile(os.path.join(directory, shard)):
            raise InputError(f"{path}: names shard {shard}, which is not in {directory}; "
                             "copy the missing shard or fix the index")
    return [os.path.join(directory, shard) for shard in shards]


def directory_shapes(directory: str) -> Optional[Tuple[str, Dict[str, Shape]]]:
    """(the file that lists them, shapes) of the weight files transformers would read in
    ``directory``, in its order of preference; None when there are none (transformers
    names that itself)."""
    for single, index, read in (_SAFETENSORS + (safetensors_shapes,),
                                _PICKLES + (pickle_shapes,)):
        if os.path.isfile(os.path.join(directory, single)):
            return single, read(os.path.join(directory, single))
        if os.path.isfile(os.path.join(directory, index)):
            shapes: Dict[str, Shape] = {}
            for shard in _index_shards(directory, index):
                shapes.update(read(shard))
            return index, shapes
    return None
