"""Where a Hugging Face causal LM comes from: a directory, a hub id already in the local
cache, or a GGUF file.

``--hf-model`` of ``eval_jump``, ``eval_downstream`` and ``convert_from_hf`` takes any of
the three; nothing is downloaded (the hub is read offline, from the cache only).

- a directory written by ``save_pretrained`` (``config.json`` and the weight files);
- a hub id such as ``HuggingFaceTB/SmolLM2-135M`` whose snapshot is in the local cache
  (``HF_HOME`` / ``HF_HUB_CACHE``), resolved to that snapshot directory;
- a ``.gguf`` file, which transformers (with the ``gguf`` package) reads and dequantizes;
  :func:`dequantize_gguf` writes it out as a plain directory once, so the other tools and
  the trainer read ordinary safetensors.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional

from megatron_jreg.errors import InputError, missing_extra

GGUF_SUFFIX = ".gguf"


def brief(error: BaseException) -> str:
    """The exception's type and first line: transformers' messages run to paragraphs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def is_gguf(reference: str) -> bool:
    return reference.lower().endswith(GGUF_SUFFIX)


def _looks_like_hub_id(reference: str) -> bool:
    parts = reference.split("/")
    return len(parts) == 2 and all(parts) and not reference.startswith((".", "/", "~"))


def cached_snapshot(repo_id: str) -> Optional[str]:
    """The local snapshot directory of hub model ``repo_id`` (offline), or None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or an invalid id
        return None
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def resolve_hf_model(reference: str, flag: str = "--hf-model") -> str:
    """The local path of ``reference``: a model directory, a GGUF file, or the cached
    snapshot of a hub id; InputError naming the fix otherwise."""
    if os.path.isdir(reference):
        if not os.path.isfile(os.path.join(reference, "config.json")):
            raise InputError(
                f"{flag} {reference}: not a Hugging Face model directory (no config.json); "
                "give a directory written by save_pretrained or tools/convert_to_hf.py, a "
                ".gguf file, or a hub id in the local cache")
        return reference
    if os.path.isfile(reference):
        if is_gguf(reference):
            return reference
        raise InputError(
            f"{flag} {reference}: a file that is not .gguf; give a model directory written by "
            "save_pretrained, a .gguf file, or a hub id in the local cache")
    if is_gguf(reference):
        raise InputError(f"{flag} {reference}: no such file; check the path")
    if _looks_like_hub_id(reference):
        snapshot = cached_snapshot(reference)
        if snapshot is not None:
            return snapshot
        raise InputError(
            f"{flag} {reference}: no such directory, and no snapshot of a hub model of that "
            "name in the local Hugging Face cache (read offline); download it first with "
            f"`huggingface-cli download {reference}` or give a local directory")
    raise InputError(f"{flag} {reference}: no such directory; check the path")


def _import_transformers(purpose: str):
    try:
        import transformers
    except ImportError:
        raise missing_extra("transformers", "hf", purpose) from None
    return transformers


def load_gguf(path: str, dtype=None, flag: str = "--hf-model"):
    """(model, tokenizer) from a GGUF file, dequantized by transformers (needs ``gguf``)."""
    import torch

    transformers = _import_transformers(flag)
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise InputError(
            f"{flag} {path}: reading a GGUF file needs the gguf package; install it with "
            "`pip install gguf` (it comes with the hf extra)") from None
    directory, name = os.path.split(os.path.abspath(path))
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=name, dtype=dtype or torch.float32)
    except Exception as err:
        raise InputError(
            f"{flag} {path}: transformers cannot read this GGUF file ({brief(err)}); "
            "check that it is a causal LM of an architecture transformers reads from GGUF"
        ) from None
    return plain_model(model), tokenizer


def plain_model(model):
    """The same weights in a model that is not marked as quantized: transformers keeps a
    GGUF-loaded model's quantizer attached, which refuses ``save_pretrained``."""
    if getattr(model.config, "quantization_config", None) is None and \
            getattr(model, "hf_quantizer", None) is None:
        return model
    import torch
    import transformers

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = model.state_dict()
    with torch.device("meta"):
        fresh = type(model)(config)
    fresh.load_state_dict(state, strict=True, assign=True)
    fresh.tie_weights()
    fresh.eval()
    return fresh if isinstance(fresh, transformers.PreTrainedModel) else model


def dequantize_gguf(path: str, output: str, flag: str = "--hf-model") -> str:
    """Write GGUF file ``path`` as a plain fp32 Hugging Face directory ``output``
    (atomically: a temporary directory renamed). Returns ``output``."""
    if os.path.exists(output):
        raise InputError(f"{output}: already exists; remove it or choose a new directory")
    model, tokenizer = load_gguf(path, flag=flag)
    parent = os.path.dirname(os.path.abspath(output)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.normpath(output))}.", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def load_causal_lm(reference: str, dtype=None, device_map: Optional[str] = None,
                   flag: str = "--hf-model"):
    """(model, tokenizer, local path) for any ``reference`` :func:`resolve_hf_model` takes.

    ``device_map`` (e.g. ``auto``) spreads the layers over the visible devices with
    accelerate, for models larger than one GPU."""
    import torch

    path = resolve_hf_model(reference, flag)
    dtype = dtype or torch.float32
    if is_gguf(path):
        model, tokenizer = load_gguf(path, dtype, flag)
        return model.to(dtype), tokenizer, path
    transformers = _import_transformers(flag)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {"dtype": dtype}
    if device_map is not None:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise InputError(f"--device-map {device_map} needs accelerate; pip install "
                             "accelerate (or drop --device-map)") from None
        kwargs["device_map"] = device_map
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as err:
        raise InputError(
            f"{flag} {reference}: cannot load a causal LM ({brief(err)}); "
            "check config.json and the weight files") from None
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise InputError(
            f"{flag} {reference}: cannot load its tokenizer ({brief(err)}); the directory "
            "needs the tokenizer files written by tokenizer.save_pretrained") from None
    return model, tokenizer, path
