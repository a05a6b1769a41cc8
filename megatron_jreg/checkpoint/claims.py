"""What a checkpoint says its model is, compared with the tensors it lists, before either is
believed.

:func:`check` (called by ``formats.describe``, so every reader goes through it) compares the
model section of ``run_config.yaml`` (or Megatron-LM's ``args``) with the global shapes
``.metadata`` lists (``model.weight_shapes``) and the bytes of the shard files, before any
model is built: a claim the tensors do not bear out is one line naming the field, its value
and what the tensors hold.
"""

from __future__ import annotations

import math
import os
from typing import Dict, Optional, Sequence, Tuple

from megatron_jreg.checkpoint import faults
from megatron_jreg.errors import InputError
from megatron_jreg.model import weight_shapes as ws

METADATA = ".metadata"

# the weights whose shapes decide a model's size, and the fields that set each
_DECISIVE: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    (ws.QKV, ("num_attention_heads", "num_query_groups")),
    (ws.FC1, ("ffn_hidden_size", "swiglu", "num_experts")),
    (ws.FC2, ("ffn_hidden_size", "num_experts")),
    (ws.ROUTER, ("num_experts",)),
    (ws.EXPERT_FC1, ("num_experts", "moe_ffn_hidden_size", "swiglu")),
    (ws.EXPERT_FC2, ("num_experts", "moe_ffn_hidden_size")),
)


def _shape(shape: Optional[Sequence[int]]) -> str:
    return "no such tensor" if shape is None else f"[{', '.join(str(d) for d in shape)}]"


def check(opened, model, claimed_by: str, fix: str) -> None:
    """Refuse ``model`` (the ModelConfig iteration ``opened`` claims, ``claimed_by`` naming
    where: ``.../run_config.yaml: model``) where the tensors its ``.metadata`` lists
    disagree; ``fix`` ends the line. Without ``.metadata`` nothing is compared here (the
    load names the missing file before it builds)."""
    if opened.metadata is None:
        return
    listed = opened.entries()
    meta = os.path.join(opened.path, METADATA)

    def refuse(fields: str, held: str) -> None:
        raise InputError(f"{claimed_by}.{fields}, but {meta} lists {held}; {fix}")

    proj = listed.get(ws.PROJ)
    if not proj:
        raise faults.NotAModel(root=opened.ref.root, detail=(
            f"{opened.path} holds no {ws.PROJ}; not a GPT checkpoint"))
    if model.num_layers != proj[0]:
        refuse(f"num_layers is {model.num_layers}",
               f"tensors of {proj[0]} layers ({ws.PROJ} is {_shape(proj)})")
    rows = listed.get(ws.EMBEDDING)
    if rows and len(rows) == 2 and model.hidden_size != rows[1]:
        refuse(f"hidden_size is {model.hidden_size}",
               f"a hidden size of {rows[1]} ({ws.EMBEDDING} is {_shape(rows)})")
    expected = ws.weight_shapes(model)
    for key, fields in _DECISIVE:
        want, got = expected.get(key), listed.get(key)
        if want is None and got is None:
            continue
        if want is not None and got is not None and tuple(got) == want:
            continue
        values = [f"{f} {getattr(model, f)}" for f in fields]
        named = values[0] + (f" with {', '.join(values[1:])}" if len(values) > 1 else "")
        made = f"makes {key} {_shape(want)}" if want else f"makes no {key}"
        refuse(f"{named} {made}", f"{key} {_shape(got)}" if got else f"no {key}")
    _check_storage(opened, meta)


def _check_storage(opened, meta: str) -> None:
    """The model's tensors as ``.metadata`` lists them take no more bytes than the shard
    files hold: a listing of tensors the directory does not have is not believed."""
    saved = opened.metadata.state_dict_metadata
    claimed, biggest = 0, ("", 0)
    for key, value in saved.items():
        size = getattr(value, "size", None)
        if size is None or key.startswith("optimizer."):
            continue
        dtype = getattr(getattr(value, "properties", None), "dtype", None)
        nbytes = math.prod(size) * int(getattr(dtype, "itemsize", 1) or 1)
        claimed += nbytes
        if nbytes > biggest[1]:
            biggest = (key, nbytes)
    held = _shard_bytes(opened)
    if claimed > held:
        key = biggest[0]
        raise faults.DamagedFile(path=opened.path, checksum=False, detail=(
            f"{meta} lists model tensors of {claimed} bytes ({key} is "
            f"{_shape(saved[key].size)}), but its shard files hold {held} bytes"))


def _shard_bytes(opened) -> int:
    names: Dict[str, None] = {}
    for info in (getattr(opened.metadata, "storage_data", None) or {}).values():
        names[str(getattr(info, "relative_path", ""))] = None
    total = 0
    for name in names:
        try:
            total += os.stat(os.path.join(opened.path, name)).st_size
        except OSError:
            continue  # trusted.open_iteration named every missing one already
    return total
