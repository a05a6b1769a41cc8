"""What a Hugging Face model's config claims about its architecture, checked against what
its weight files list, before any model is built or any tensor read.

:func:`check_claims` (called by ``hf_models.resolve_hf_model``) type-checks each
architecture field of config.json or GGUF metadata and compares it with the shapes in the
weight files' headers (:mod:`.weight_headers`, the gguf reader); a field the weights say
nothing about is held to a bound no model reaches. Each problem is one InputError.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_jreg.errors import InputError
from megatron_jreg.hf_models.weight_headers import Shape, directory_shapes, first_line, shown

# the config.json names of each architecture field, across the model types transformers has
ROLES: Dict[str, Tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "n_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "ffn": ("intermediate_size", "n_inner", "ffn_dim"),
    "vocab": ("vocab_size",),
}
_ROLE_OF = {name: role for role, names in ROLES.items() for name in names}
# Sizes no model has (the largest published ones are 10-50 times below): the bound of a
# field the weights do not confirm, so that an absurd value is refused even then.
LIMITS = {"layers": 4096, "hidden": 1 << 17, "heads": 4096, "kv_heads": 4096,
          "head_dim": 8192, "ffn": 1 << 20, "vocab": 1 << 23}
# parts of a tensor name that belong to another tower than the text decoder
_OTHER_TOWERS = ("vision", "visual", "image", "audio", "speech", "encoder", "mm_projector")


def count_problem(value) -> Optional[str]:
    """What a size field should have held, or None when ``value`` is an integer >= 1 (a
    bool is not one, nor is 2.0: transformers would build with it as given)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return None
    return "an integer >= 1"


@dataclass
class Claim:
    source: str  # the file shown: a config.json or a .gguf file
    field: str  # as the file spells it: text_config.num_hidden_layers, llama.block_count
    role: str  # a key of ROLES
    value: object

    def refuse(self, what: str) -> InputError:
        return InputError(f"{self.source}: {self.field} is {shown(self.value)}, {what}; "
                          "correct it in that file")


# ---- what the shapes say about each field -----------------------------------------------------


@dataclass(frozen=True)
class Naming:
    """Where a family of weight files keeps what each field sizes."""

    stack: "re.Pattern[str]"  # the decoder stack: group 1 its prefix, group 2 the layer index
    embedding: Tuple[str, ...]  # name suffixes of the input embedding ([vocab, hidden])
    norm: Tuple[str, ...]  # a layer's local names of its first norm ([hidden])
    query: Tuple[str, ...]  # a layer's local names of the query projection ([heads * d, h])
    key: Tuple[str, ...]
    ffn: Tuple[Tuple["re.Pattern[str]", int], ...]  # a layer's dense FFN: (local name, dim)


HF_NAMING = Naming(
    stack=re.compile(r"^((?:.*?\.)?(?:layers|h|blocks|layer))\.(\d+)\."),
    embedding=("embed_tokens.weight", "wte.weight", "word_embeddings.weight",
               "embed_in.weight", "tok_embeddings.weight"),
    norm=("input_layernorm.weight", "ln_1.weight", "self_attn_layer_norm.weight",
          "attention_norm.weight"),
    query=("self_attn.q_proj.weight", "attn.q_proj.weight", "attention.wq.weight"),
    key=("self_attn.k_proj.weight", "attn.k_proj.weight", "attention.wk.weight"),
    ffn=tuple((re.compile(p), d) for p, d in (
        (r"mlp\.(?:gate|up)_proj\.weight", 0), (r"mlp\.fc_in\.weight", 0),
        (r"mlp\.dense_h_to_4h\.weight", 0), (r"fc1\.weight", 0),
        (r"mlp\.c_fc\.weight", 1),  # GPT-2's Conv1D: [hidden, inner]
        (r"feed_forward\.w1\.weight", 0), (r"block_sparse_moe\.experts\.\d+\.w1\.weight", 0))),
)
GGUF_NAMING = Naming(  # shapes in torch's order (GGUF lists the innermost dimension first)
    stack=re.compile(r"^(blk)\.(\d+)\."), embedding=("token_embd.weight",),
    norm=("attn_norm.weight",), query=("attn_q.weight",), key=("attn_k.weight",),
    ffn=((re.compile(r"ffn_up\.weight"), 0), (re.compile(r"ffn_up_exps\.weight"), 1)),
)


def _ranges(indices: Sequence[int]) -> str:
    """0-5 for 0..5; 0-1, 5 for gaps."""
    parts, start = [], indices[0]
    for prev, cur in zip(indices, list(indices[1:]) + [None]):
        if cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(parts)


class Weights:
    """The shapes of one model's weight files, read by role under ``naming``."""

    def __init__(self, listed_in: str, shapes: Dict[str, Shape], naming: Naming):
        self.listed_in = listed_in
        self.naming = naming
        self.shapes = {n: s for n, s in shapes.items()
                       if not any(t in n.lower() for t in _OTHER_TOWERS)}
        self.stacks: Dict[str, List[int]] = {}
        self.local: List[Tuple[str, str, Shape]] = []  # (full name, name in its layer, shape)
        for name, shape in self.shapes.items():
            match = naming.stack.match(name)
            if match:
                self.stacks.setdefault(match.group(1), []).append(int(match.group(2)))
                self.local.append((name, name[match.end():], shape))
        self.stacks = {prefix: sorted(set(ix)) for prefix, ix in self.stacks.items()}

    def _sizes(self, items: Iterator[Tuple[str, Shape]], dim: int) -> Dict[int, str]:
        """{size: the first tensor showing it, as 'NAME is [a, b]'}."""
        sizes: Dict[int, str] = {}
        for name, shape in items:
            if len(shape) > dim:
                sizes.setdefault(shape[dim], f"{name} is {list(shape)}")
        return sizes

    def in_layers(self, locals_: Tuple[str, ...], dim: int = 0) -> Dict[int, str]:
        return self._sizes(((n, s) for n, local, s in self.local if local in locals_), dim)

    def embedding_rows(self) -> Dict[int, str]:
        return self._sizes(((n, s) for n, s in self.shapes.items()
                            if n.endswith(self.naming.embedding) and len(s) == 2), 0)

    def ffn_sizes(self) -> Dict[int, str]:
        sizes: Dict[int, str] = {}
        for pattern, dim in self.naming.ffn:
            found = self._sizes(((n, s) for n, local, s in self.local
                                 if pattern.fullmatch(local)), dim)
            for size, text in found.items():
                sizes.setdefault(size, text)
        return sizes


def _mismatch(claim: Claim, sizes: Dict[int, str], what: str) -> None:
    if sizes and claim.value not in sizes:
        size, evidence = next(iter(sizes.items()))
        raise claim.refuse(f"but the weights hold {size} {what} ({evidence})")


def _compare(claims: Dict[str, Claim], weights: Weights, extra_layers: int = 0) -> set:
    """Refuse the first claim the shapes contradict; returns the roles they confirmed."""
    confirmed = set()
    layers = claims.get("layers")
    if layers is not None and weights.stacks:
        counts = {len(ix) for ix in weights.stacks.values()}
        if not counts & {layers.value, layers.value + extra_layers}:
            prefix = max(weights.stacks, key=lambda p: len(weights.stacks[p]))
            indices = weights.stacks[prefix]
            where = f" under {prefix}" if len(weights.stacks) > 1 else ""
            raise layers.refuse(f"but the weights hold layers {_ranges(indices)} "
                                f"({len(indices)}){where}")
        confirmed.add("layers")
    checks = [("vocab", weights.embedding_rows(), "embedding rows"),
              ("hidden", weights.in_layers(weights.naming.norm), "as the hidden size"),
              ("ffn", weights.ffn_sizes(), "as the FFN size")]
    for role, sizes, what in checks:
        claim = claims.get(role)
        if claim is not None and sizes:
            _mismatch(claim, sizes, what)
            confirmed.add(role)
    # The query and key rows are heads x head_dim. Without head_dim in the file,
    # hidden // heads is only a guess (some model types default it otherwise, Qwen3 to
    # 128), so the counts are then held by the bound, not by the rows.
    heads, head_dim = claims.get("heads"), claims.get("head_dim")
    if heads is None or head_dim is None:
        return confirmed
    for claim, names, what in ((heads, weights.naming.query, "query"),
                               (claims.get("kv_heads"), weights.naming.key, "key")):
        rows = weights.in_layers(names)
        if claim is None or not rows:
            continue
        # Qwen3-Next's gated attention: the query projection also holds the gate
        expected = claim.value * head_dim.value
        if expected in rows or (what == "query" and 2 * expected in rows):
            confirmed.update({claim.role, "head_dim"})
            continue
        size, evidence = next(iter(rows.items()))
        # which of the two factors is wrong, the weights cannot tell: both are named
        raise InputError(f"{claim.source}: {claim.field} x {head_dim.field} is "
                         f"{shown(claim.value)} x {shown(head_dim.value)}, but the weights hold "
                         f"{size} {what} rows ({evidence}); correct it in that file")
    return confirmed


def _check(claims: List[Claim], weights: Optional[Weights], extra_layers: int = 0) -> None:
    """Type-check every claim, compare those of one config with the weights, and hold what
    the weights did not confirm to LIMITS."""
    for claim in claims:
        values = (claim.value or [None]) if isinstance(claim.value, list) and claim.role in (
            "ffn", "heads", "kv_heads") else [claim.value]  # per-layer lists (Gemma 3n, OpenELM)
        for value in values:
            kind = count_problem(value)
            if kind:
                raise claim.refuse(f"not {kind}")
    scalar = {c.role: c for c in claims if not isinstance(c.value, list)}
    confirmed = _compare(scalar, weights, extra_layers) if weights is not None else set()
    for claim in claims:
        limit = LIMITS[claim.role]
        values = claim.value if isinstance(claim.value, list) else [claim.value]
        if claim.role not in confirmed and max(values) > limit:
            why = (f"{weights.listed_in} does not show it" if weights is not None
                   else "no weight file is here to say otherwise")
            raise claim.refuse(f"not an integer from 1 to {limit} (no model has more, and "
                               f"{why})")


# ---- the claims ----------------------------------------------------------------------------


def _config_claims(config: Dict[str, object], source: str, prefix: str = "") -> List[Claim]:
    """The architecture fields of one config dict (null: the model type's default)."""
    claims, seen = [], set()
    for name, value in config.items():
        role = _ROLE_OF.get(name)
        if role is None or value is None or role in seen:
            continue
        seen.add(role)  # the first spelling of a field is the one transformers reads
        claims.append(Claim(source, prefix + name, role, value))
    return claims


def read_config_json(directory: str, label: str) -> dict:
    """``directory``'s config.json as a dict; else one InputError opened by ``label``."""
    source = os.path.join(directory, "config.json")
    try:
        with open(source, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise InputError(f"{label}: cannot load {source} ({first_line(err)}); fix or "
                         "replace the file") from None
    if not isinstance(config, dict):
        raise InputError(f"{label}: cannot load {source}: not a JSON object; fix or replace "
                         "the file")
    return config


def _check_directory(directory: str, label: str) -> None:
    source = os.path.join(directory, "config.json")
    config = read_config_json(directory, label)
    listed = directory_shapes(directory)
    weights = Weights(listed[0], listed[1], HF_NAMING) if listed else None
    extra = config.get("num_nextn_predict_layers")  # DeepSeek-V3's MTP layer is layers.N
    extra = extra if isinstance(extra, int) and not isinstance(extra, bool) else 0
    # the decoder's config: the top level, or text_config of a multimodal model; the other
    # towers' configs (vision_config, ...) are type-checked and bounded
    _check(_config_claims(config, source), weights, extra)
    for name, nested in config.items():
        if name.endswith("_config") and isinstance(nested, dict):
            text = name == "text_config"
            _check(_config_claims(nested, source, f"{name}."), weights if text else None,
                   extra if text else 0)


@functools.lru_cache(maxsize=8)
def _check_gguf(path: str, size: int, mtime_ns: int) -> None:  # noqa: ARG001 - cache key
    """The GGUF header parsed once per file version: every reader goes through this, some
    twice (convert_from_hf resolves, then loads)."""
    try:
        from gguf import GGUFReader
    except ImportError:  # the loader names the missing package
        return
    try:
        reader = GGUFReader(path)
        fields = reader.fields
        field = fields.get("general.architecture")
        arch = field.contents() if field is not None else None
        shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist()))
                  for t in reader.tensors}
    except (OSError, ValueError, IndexError, KeyError, UnicodeDecodeError) as err:
        raise InputError(f"{path}: not a readable GGUF file ({first_line(err)}); check the "
                         "file") from None
    try:
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
    except ImportError:
        return
    claims = []
    for suffix, hf_field in GGUF_CONFIG_MAPPING.get(str(arch), {}).items():
        key = f"{arch}.{suffix}"
        role = _ROLE_OF.get(hf_field or "")
        if role is not None and key in fields:
            claims.append(Claim(path, key, role, fields[key].contents()))
    _check(claims, Weights(os.path.basename(path), shapes, GGUF_NAMING))


def check_claims(path: str, label: str) -> None:
    """Refuse, in one InputError, an architecture field of ``path`` (a model directory
    with config.json, or a .gguf file) that is not a count, that the weight files' own
    headers contradict, or that is beyond any model when they say nothing about it.
    ``label`` (``--hf-model REF``) opens the line when config.json cannot be read."""
    if os.path.isdir(path):
        _check_directory(path, label)
    elif os.path.isfile(path):
        st = os.stat(path)
        _check_gguf(os.path.realpath(path), st.st_size, st.st_mtime_ns)
