"""Hidden states of any Hugging Face causal LM, captured with layer hooks (``eval_jump
--hf-model``).

:func:`hf_entries` turns the flags into entries; the model is a directory, a hub id already in
the local cache, or a GGUF file (:mod:`megatron_jreg.hf_models` resolves and loads all three,
offline), and :class:`HFCausalLMSource` feeds its per-layer pairs to the accumulator.
``transformers`` is an optional extra, imported only when a model is loaded.
"""

from __future__ import annotations

import os
from typing import List, Optional, Tuple

import torch

from megatron_jreg import hf_models
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.analysis.layer_capture import LayerCapture
from megatron_jreg.analysis.source_flags import HFSourceFlags
from megatron_jreg.analysis.sources import SourceEntry
from megatron_jreg.errors import InputError
from megatron_jreg.platform.device import resolve_device

# (decoder layers, final norm) attribute paths, tried in order.
_LAYOUTS: Tuple[Tuple[str, str], ...] = (
    ("model.layers", "model.norm"),  # Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3, OLMo
    ("model.language_model.layers", "model.language_model.norm"),  # Gemma 3 and other wrappers
    ("model.decoder.layers", "model.decoder.final_layer_norm"),  # OPT
    ("gpt_neox.layers", "gpt_neox.final_layer_norm"),  # Pythia / GPT-NeoX
    ("transformer.h", "transformer.ln_f"),  # GPT-2, GPT-J, Falcon, BLOOM
)



def _get_path(obj: object, path: str) -> Optional[object]:
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def find_decoder_layers(model: torch.nn.Module) -> Tuple[torch.nn.ModuleList, torch.nn.Module]:
    """The decoder layers and the final norm of a causal LM, for the common layouts."""
    for layers_path, norm_path in _LAYOUTS:
        layers = _get_path(model, layers_path)
        norm = _get_path(model, norm_path)
        if isinstance(layers, torch.nn.ModuleList) and isinstance(norm, torch.nn.Module):
            return layers, norm
    raise InputError(
        f"{type(model).__name__}: cannot find the decoder layers and final norm "
        f"(looked for {', '.join(p for p, _ in _LAYOUTS)}); add the layout to "
        "megatron_jreg/analysis/hf_source.py:_LAYOUTS"
    )


def _input_device(model: torch.nn.Module) -> torch.device:
    """Where the token ids go: the input embedding's device (under a device map, where the
    first layers run; accelerate's hooks move what each later layer needs)."""
    weight = getattr(model.get_input_embeddings(), "weight", None)
    if weight is not None and not weight.is_meta:
        return weight.device
    for param in model.parameters():
        if not param.is_meta:
            return param.device
    return torch.device("cpu")


class HFCausalLMSource:
    """A loaded HF causal LM whose decoder layers feed a JumpAccumulator through hooks.

    h_0 is the input of decoder layer 1 (the embedding output, after any scaling the model
    applies, e.g. Gemma's sqrt(hidden)); h_l is the output of decoder layer l; h_L is taken
    before the final norm unless ``include_final_norm``, in which case it is
    ``final_norm(h_L)``, the last entry of HF's ``output_hidden_states``. Under
    ``--device-map`` each pair is brought to one device before psi is computed (in fp32).
    """

    def __init__(
        self, model: torch.nn.Module, tokenizer, name: str, include_final_norm: bool = False
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.include_final_norm = include_final_norm
        self.layers, self.final_norm = find_decoder_layers(model)
        self.num_layers = len(self.layers)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        pad = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.pad_id = int(pad) if pad is not None else 0
        self.device = _input_device(model)
        self._capture = LayerCapture(name, list(enumerate(self.layers, start=1)),
                                     self.num_layers, self.final_norm, include_final_norm)

    def tokenize(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])

    @torch.no_grad()
    def accumulate(self, input_ids: torch.Tensor, mask: torch.Tensor, acc: JumpAccumulator) -> None:
        config = self.model.config
        limit = getattr(config, "n_positions", None)  # learned positions (GPT-2): a hard limit
        if limit is not None and input_ids.shape[1] > limit:
            raise InputError(f"--seq-length {input_ids.shape[1]}: the model has learned positions "
                             f"for {limit} tokens only; pass --seq-length {limit} or less")
        self._capture.run(
            acc,
            mask.to(self.device),  # [b, s], like the hidden states
            lambda: self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device, torch.long),
                use_cache=False,
            ),
        )


def load_hf_source(
    path: str,
    include_final_norm: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
    name: Optional[str] = None,
    device_map: Optional[str] = None,
) -> HFCausalLMSource:
    """Load model and tokenizer of ``path`` (a directory, a cached hub id or a .gguf file)
    with transformers: fp32 on the CPU by default, spread by accelerate with ``device_map``."""
    if dtype not in hf_models.DTYPE_NAMES:
        raise InputError(f"--dtype {dtype}: choose one of {sorted(hf_models.DTYPE_NAMES)}")
    hf_models.check_device_map(device_map, device)
    dev = resolve_device(device)
    model, tokenizer, _ = hf_models.load_causal_lm(path, hf_models.torch_dtype(dtype),
                                                    device_map=device_map)
    if device_map is None:
        model.to(dev)
    label = name or hf_models.default_label(path)
    return HFCausalLMSource(model, tokenizer, label, include_final_norm=include_final_norm)


def hf_entries(
    flags: HFSourceFlags,
    *,
    include_final_norm: bool = False,
    device: str = "cpu",
    dtype: str = "float32",
) -> List[SourceEntry]:
    """One entry per model of ``flags.hf_model`` (none when it is empty), run on ``device``
    (or spread by ``flags.device_map``) in ``dtype``. Every reference is resolved now, so a
    missing model fails before any model loads."""
    device_map = flags.device_map
    hf_models.check_device_map(device_map, device)
    entries = []
    for reference in flags.hf_model or []:
        local = hf_models.resolve_hf_model(reference)  # fails fast, before any model loads
        hub_id = os.path.abspath(local) != os.path.abspath(reference)

        def open_source(reference: str = reference) -> HFCausalLMSource:
            return load_hf_source(reference, include_final_norm, device, dtype,
                                  device_map=device_map)

        entries.append(
            SourceEntry(
                label=hf_models.default_label(reference),
                open=open_source,
                describe=reference if hub_id else os.path.abspath(reference),
                extra={"snapshot": local} if hub_id else {},
            )
        )
    return entries
