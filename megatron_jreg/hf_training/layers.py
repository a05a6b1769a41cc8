"""The decoder layers of any Hugging Face causal LM, found from the model itself.

:func:`decoder_layers` (called by :class:`HFJreg`) takes the outermost ``nn.ModuleList`` whose
length is a layer count the model's config states; the layers may be of several classes (a
hybrid's attention, Mamba and cross-attention layers form one stack). Nothing here names a
family: a model whose config or modules do not say, an encoder-decoder model and a model that
is not a causal LM are refused, naming the model's class.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from megatron_jreg.errors import InputError

_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")


def _stated_counts(config) -> List[int]:
    """Every decoder layer count ``config`` states, its text model's first. A BART-family
    config's ``num_hidden_layers`` is its encoder's: its decoder's is ``decoder_layers``."""
    counts: List[int] = []
    for cfg in (getattr(config, "text_config", None), config):
        if cfg is None:
            continue
        for name in ("decoder_layers",) + _LAYER_COUNTS:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
                    and value not in counts:
                counts.append(value)
    return counts


def layer_count(config) -> Optional[int]:
    """The number of decoder layers a config states first (its text model's, for a model
    with several towers), or None."""
    counts = _stated_counts(config)
    return counts[0] if counts else None


def _outermost_lists(model: torch.nn.Module) -> List[Tuple[str, torch.nn.ModuleList]]:
    """(path, list) of every ModuleList that sits inside no other ModuleList: lists inside a
    layer (per-head norms, a layer's sub-blocks) are never taken for the decoder."""
    lists = [(path, module) for path, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList)]
    paths = [path for path, _ in lists]
    return [(path, module) for path, module in lists
            if not any(path.startswith(other + ".") for other in paths if other != path)]


def _causal_refusal(model: torch.nn.Module, layers: torch.nn.ModuleList) -> Optional[str]:
    """Why ``model`` is not a causal LM, or None. Its attention modules say (``is_causal``);
    a model whose layers have none (Mamba, RWKV) is one when it can generate."""
    flags = {module.is_causal for module in layers.modules()
             if isinstance(getattr(module, "is_causal", None), bool)}
    if flags == {False}:
        return "its attention sees later tokens"
    can_generate = getattr(model, "can_generate", None)
    if not flags and callable(can_generate) and not can_generate():
        return "it has no causal attention and no generation head"
    return None


def decoder_layers(model: torch.nn.Module) -> Tuple[str, torch.nn.ModuleList]:
    """(its attribute path, the ModuleList) of ``model``'s decoder layers: the one outermost
    list whose length is a layer count the config states. Raises InputError naming the
    model's class when the config states no layer count, no list (or more than one) matches
    it, or the model is not a causal LM."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        # the layer-list search would find the encoder's blocks (T5, BART) and regularize
        # the encoder while the decoder that generates goes untouched
        raise InputError(f"{name} is an encoder-decoder model; JREG's displacement is defined "
                         "for a decoder-only stack: give a causal LM")
    counts = _stated_counts(config)
    if not counts:
        raise InputError(f"{name}: its config states no number of layers "
                         f"({', '.join(('decoder_layers',) + _LAYER_COUNTS)}); JREG needs the "
                         "decoder layers")
    found = [(path, module) for path, module in _outermost_lists(model)
             if len(module) in counts]
    if len(found) != 1:
        what = ("none" if not found else
                f"{len(found)} ({', '.join(path for path, _ in found)})")
        stated = " or ".join(str(count) for count in counts)
        raise InputError(f"{name}: cannot tell its decoder layers: outermost lists of {stated} "
                         f"layers (its config's layer count) found: {what}")
    path, layers = found[0]
    why = _causal_refusal(model, layers)
    if why is not None:
        raise InputError(f"{name} is not a causal LM ({why}); JREG here is for causal LMs: "
                         "give one (e.g. loaded with AutoModelForCausalLM)")
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
