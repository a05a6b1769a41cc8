"""The decoder layers of any Hugging Face causal LM, found from the model itself.

A model's decoder is its one ``nn.ModuleList`` holding ``num_hidden_layers`` modules of one
class (the config says how many: ``num_hidden_layers``, GPT-2's ``n_layer``, or a multimodal
model's ``text_config``). Nothing here names a family: a model whose config or modules do
not say is refused naming its class, and so are an encoder-decoder model (its encoder's
blocks would be taken for the decoder) and a list holding one module in two slots.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

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
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        # the layer-list search would find the encoder's blocks (T5, BART) and regularize
        # the encoder while the decoder that generates goes untouched
        raise InputError(f"{name} is an encoder-decoder model; JREG's displacement is defined "
                         "for a decoder-only stack: give a causal LM")
    count = layer_count(config)
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
    path, layers = found[0]
    first: Dict[int, int] = {}
    for index, layer in enumerate(layers):
        if id(layer) in first:
            # one hook per slot would sit twice on the module and fire twice per call: the
            # two slots' pairs could not be told apart
            raise InputError(f"{name}: {path}[{first[id(layer)]}] and {path}[{index}] are the "
                             "same module; JREG needs one module per layer (copy the layer, "
                             "or give a model whose layers are distinct)")
        first[id(layer)] = index
    return path, layers
