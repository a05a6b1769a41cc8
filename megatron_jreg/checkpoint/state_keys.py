"""What a model asks of a checkpoint against what the checkpoint holds, before any tensor
is read: missing and unexpected entries are named, shapes compared, and Transformer
Engine's ``_extra_state`` entries present on one side only are tolerated.

Transformer Engine's modules keep per-module extra state (FP8 scaling metadata) as
``..._extra_state`` entries; a model built with megatron-core's local spec has some of them
(the linear layers', empty) and not others (the core attention's). A checkpoint saved by
one implementation therefore lacks entries the other asks for, or carries entries it does
not use: neither holds a weight, so the load goes on without them and says so once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import torch.distributed as dist

EXTRA_STATE = "_extra_state"


def base_key(key: str) -> str:
    """A stored entry's key without the shard suffix of a sharded object."""
    return key.split("/shard_")[0]


def is_extra_state(key: str) -> bool:
    return base_key(key).endswith(EXTRA_STATE)


def checkpoint_entries(
        entries: Dict[str, Optional[Tuple[int, ...]]]) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Key -> global shape of each tensor the checkpoint holds (None for objects), from the
    trusted open's ``Opened.entries()``."""
    return {base_key(k): shape for k, shape in entries.items()}


def requested_entries(sharded_state_dict) -> Dict[str, Optional[Tuple[int, ...]]]:
    """Key -> global shape of each entry a (nested) sharded state dict asks for (None for
    objects and factories, whose stored shape is not the requested one)."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor

    out: Dict[str, Optional[Tuple[int, ...]]] = {}

    def walk(node):
        if isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)
        elif isinstance(node, ShardedBase):  # tensors, objects and factories
            out[node.key] = tuple(node.global_shape) if isinstance(node, ShardedTensor) else None

    walk(sharded_state_dict)
    return out


def drop_requests(sharded_state_dict, keys: Set[str]):
    """The sharded state dict without the entries whose key is in ``keys``."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(sharded_state_dict, dict):
        return {k: drop_requests(v, keys) for k, v in sharded_state_dict.items()
                if not (isinstance(v, ShardedBase) and v.key in keys)}
    return sharded_state_dict


@dataclass
class Comparison:
    """The model's requests against the checkpoint, over all ranks."""

    missing: List[str] = field(default_factory=list)  # asked for, not in the checkpoint
    unexpected: List[str] = field(default_factory=list)  # model entries nobody asked for
    shapes: List[str] = field(default_factory=list)  # "key: checkpoint (..), this model (..)"
    extra_missing: Set[str] = field(default_factory=set)  # _extra_state asked for, absent
    extra_unused: List[str] = field(default_factory=list)  # _extra_state stored, unused

    def problem(self) -> Optional[str]:
        """One line naming what does not match (the first few of each), or None."""
        parts = []
        for what, keys in (("lacks", self.missing), ("holds entries this model does not have:",
                                                     self.unexpected)):
            if keys:
                more = f" and {len(keys) - 4} more" if len(keys) > 4 else ""
                shown = ", ".join(keys[:4]) + more
                parts.append(f"the checkpoint {what} {shown}")
        if self.shapes:
            parts.append("shapes differ: " + "; ".join(self.shapes[:3])
                         + (f" and {len(self.shapes) - 3} more" if len(self.shapes) > 3 else ""))
        return "; ".join(parts) or None

    def notes(self) -> List[str]:
        """The lines saying which _extra_state entries were left out (at most two)."""
        out = []
        if self.extra_missing:
            out.append(f"this model's {_named(sorted(self.extra_missing))} (Transformer Engine's "
                       "FP8 metadata) are not in the checkpoint, saved by a model without them "
                       "(e.g. megatron-core's local spec): they start fresh; no weight is affected")
        if self.extra_unused:
            out.append(f"the checkpoint's {_named(self.extra_unused)} are not used by this model "
                       "(saved with Transformer Engine); no weight is affected")
        return out


def _named(keys: List[str]) -> str:
    shown = ", ".join(keys[:2]) + (f" and {len(keys) - 2} more" if len(keys) > 2 else "")
    return f"_extra_state entries ({shown})"


def compare(model_requests: Dict[str, Optional[Tuple[int, ...]]],
            stored: Dict[str, Optional[Tuple[int, ...]]]) -> Comparison:
    """Compare the model part of the requests with what is stored. Collective when
    distributed: a pipeline stage asks for its own part only, so the requests of every rank
    are compared together and every rank reaches the same verdict."""
    everyone = dict(model_requests)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: List[Dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, model_requests)
        for part in gathered:
            everyone.update(part)
    roots = {k.split(".")[0] for k in everyone}
    result = Comparison()
    for key, shape in sorted(everyone.items()):
        if key not in stored:
            if key.endswith(EXTRA_STATE):
                result.extra_missing.add(key)
            else:
                result.missing.append(key)
        elif shape is not None and stored[key] is not None and shape != stored[key]:
            result.shapes.append(f"{key}: checkpoint {stored[key]}, this model {shape}")
    for key in sorted(stored):
        if key.split(".")[0] in roots and key not in everyone:
            (result.extra_unused if key.endswith(EXTRA_STATE) else result.unexpected).append(key)
    return result
