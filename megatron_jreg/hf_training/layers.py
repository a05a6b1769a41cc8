"""The decoder layers of any Hugging Face causal LM, found from the model itself.

A model's decoder is its one ``nn.ModuleList`` holding ``num_hidden_layers`` modules of one
class (the config says how many: ``num_hidden_layers``, GPT-2's ``n_layer``, or a multimodal
model's ``text_config``). Nothing here names a family: a model whose config or modules do
not say is refused naming its class.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from megatron_jreg.errors import InputError

_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")


def layer_count(config) -> Optional[int]:
    """The number of decoder layers a config states (its text model's, for a model with
    several towers), or None."""
    for cfg in (getattr(config, "text_config", None), config):
        for name in _LAYER_COUNTS:
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def decoder_layers(model: torch.nn.Module) -> Tuple[str, torch.nn.ModuleList]:
    """(its attribute path, the ModuleList) of ``model``'s decoder layers: the one list of
    the config's number of modules of one class. Raises InputError naming the model's class
    when the config states no layer count or no list (or more than one) matches it."""
    name = type(model).__name__
    count = layer_count(getattr(model, "config", None))
    if count is None:
        raise InputError(f"{name}: its config states no number of layers "
                         f"({', '.join(_LAYER_COUNTS)}); JREG needs the decoder layers")
    found: List[Tuple[str, torch.nn.ModuleList]] = [
        (path, module) for path, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == count
        and len({type(layer) for layer in module}) == 1]
    if len(found) != 1:
        what = ("none" if not found else
                f"{len(found)} ({', '.join(path for path, _ in found)})")
        raise InputError(f"{name}: cannot tell its decoder layers: lists of {count} layers of "
                         f"one class (its config's layer count) found: {what}")
    return found[0]
