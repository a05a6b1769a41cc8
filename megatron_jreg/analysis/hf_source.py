"""Hidden states of any Hugging Face causal LM directory, captured with layer hooks.

h_0 is the input of decoder layer 1 (the embedding output, after any scaling the model
applies, e.g. Gemma's sqrt(hidden)); h_l is the output of decoder layer l; h_L is taken
before the final norm unless ``include_final_norm``, in which case it is
``final_norm(h_L)``, the last entry of HF's ``output_hidden_states``.

``transformers`` is an optional extra and is imported only when a model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import List, Optional, Tuple

import torch

from megatron_jreg.analysis.devices import resolve_device
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
from megatron_jreg.analysis.layer_capture import LayerCapture
from megatron_jreg.analysis.sources import SourceEntry, SourceKind
from megatron_jreg.cli import add_fields
from megatron_jreg.errors import InputError, missing_extra

# (decoder layers, final norm) attribute paths, tried in order.
_LAYOUTS: Tuple[Tuple[str, str], ...] = (
    ("model.layers", "model.norm"),  # Llama, Mistral, Qwen2/3, Gemma 1/2, Phi-3, OLMo
    ("model.language_model.layers", "model.language_model.norm"),  # Gemma 3 and other wrappers
    ("model.decoder.layers", "model.decoder.final_layer_norm"),  # OPT
    ("gpt_neox.layers", "gpt_neox.final_layer_norm"),  # Pythia / GPT-NeoX
    ("transformer.h", "transformer.ln_f"),  # GPT-2, GPT-J, Falcon, BLOOM
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _dtype_kwarg() -> str:
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _brief(error: Exception) -> str:
    """The exception's type and first line: transformers' messages run to paragraphs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def check_hf_model_dir(path: str) -> None:
    """Fail fast on a path that cannot be a Hugging Face model directory."""
    if not os.path.exists(path):
        raise InputError(f"--hf-model {path}: no such directory; check the path")
    if not os.path.isdir(path):
        raise InputError(
            f"--hf-model {path}: not a directory; give a directory written by save_pretrained"
        )
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise InputError(
            f"--hf-model {path}: not a Hugging Face model directory (no config.json); "
            "give a directory written by save_pretrained or tools/convert_to_hf.py"
        )


class HFCausalLMSource:
    """A loaded HF causal LM whose decoder layers feed a JumpAccumulator through hooks."""

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
        self.device = next(model.parameters()).device
        self._capture = LayerCapture(name, list(enumerate(self.layers, start=1)),
                                     self.num_layers, self.final_norm, include_final_norm)

    def tokenize(self, text: str) -> List[int]:
        return list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])

    @torch.no_grad()
    def accumulate(self, input_ids: torch.Tensor, mask: torch.Tensor, acc: JumpAccumulator) -> None:
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
) -> HFCausalLMSource:
    """Load model and tokenizer from ``path`` with transformers (fp32 on CPU by default)."""
    check_hf_model_dir(path)
    dev = resolve_device(device)
    if dtype not in _DTYPES:
        raise InputError(f"--dtype {dtype}: choose one of {sorted(_DTYPES)}")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise missing_extra("transformers", "hf", "--hf-model") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # eval_jump draws its own progress over tokens
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **{_dtype_kwarg(): _DTYPES[dtype]})
    except Exception as e:
        raise InputError(
            f"--hf-model {path}: cannot load a causal LM ({_brief(e)}); "
            "check config.json and the weight files"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError variously
        raise InputError(
            f"--hf-model {path}: cannot load its tokenizer ({_brief(e)}); "
            "the directory needs the tokenizer files written by tokenizer.save_pretrained"
        ) from None
    model.to(dev)
    label = name or os.path.basename(os.path.normpath(path))
    return HFCausalLMSource(model, tokenizer, label, include_final_norm=include_final_norm)


@dataclasses.dataclass(kw_only=True)
class HFSourceFlags:
    """The flags that select Hugging Face models to measure."""

    hf_model: Optional[List[str]] = dataclasses.field(default=None, metadata={
        "metavar": "DIR",
        "help": "Hugging Face causal LM directories (Llama, Qwen, Gemma, Mistral, ...); "
        "several go on one plot. Needs the hf extra: `pip install --no-build-isolation -e "
        "'.[hf]'` from the repository root."})


def _add_arguments(group: argparse._ArgumentGroup) -> None:
    add_fields(group, HFSourceFlags)


def _build(args: argparse.Namespace) -> List[SourceEntry]:
    include_final_norm = bool(getattr(args, "include_final_norm", False))
    device = getattr(args, "device", "cpu")
    dtype = getattr(args, "dtype", "float32")
    entries = []
    for path in args.hf_model:
        check_hf_model_dir(path)

        def open_source(path: str = path) -> HFCausalLMSource:
            return load_hf_source(path, include_final_norm, device, dtype)

        entries.append(
            SourceEntry(
                label=os.path.basename(os.path.normpath(path)),
                open=open_source,
                describe=os.path.abspath(path),
            )
        )
    return entries


HF_SOURCE_KIND = SourceKind(
    name="hf",
    flag="--hf-model",
    add_arguments=_add_arguments,
    selected=lambda args: bool(getattr(args, "hf_model", None)),
    build=_build,
)
