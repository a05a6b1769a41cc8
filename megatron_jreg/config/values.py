"""The value check every config field gets where its value enters: a flag or a tool's flag
(``commands.flags`` calls :func:`check_range`), a ``--config`` YAML key (``config.yaml_settings``
calls :func:`check_value`) and a config's ``__post_init__`` (:func:`check_fields`).

Metadata ``min``/``max`` (inclusive), ``gt``/``lt`` (exclusive), ``finite=False`` (a float that
may be inf or nan) and ``choices`` bound each element of a list and never None; a message names
the source, the value and what is allowed: ``--rotary-base must be > 0, got 0``.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Mapping, Tuple

from megatron_jreg.config.schema import flag_of
from megatron_jreg.errors import ConfigError

BOUNDS = ("min", "gt", "max", "lt")
# YAML 1.1 (PyYAML) reads 1e-4 as a string: a float field takes it as a flag would
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _unwrap(annotation) -> Tuple[Any, bool]:
    """(annotation without Optional, whether None is allowed)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # noqa: S307 - annotations of our own code
    if typing.get_origin(annotation) is typing.Union or str(typing.get_origin(annotation)) == \
            "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        return (args[0] if len(args) == 1 else Any), optional
    return annotation, False


def _typed(where: str, value: Any, kind: Any) -> Any:
    """``value`` as a ``kind`` (bool, int, float, str or anything else: unchecked); a value
    of another type is refused, except numbers for a string and numeric text for a float,
    which a flag would have taken."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                return float(value)
            except OverflowError:  # an int beyond any float: refused as not finite
                return math.inf
    elif kind is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        ok = isinstance(value, str)
    else:
        return value
    if not ok:
        raise ConfigError(f"{where}: expected {_KIND_WORDS[kind]}, got {shown(value)}")
    return value


def shown(value: Any) -> str:
    """The value as written in a message: its repr, cut short (a message is one line)."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."


_PLURAL_WORDS = {bool: "true or false values", int: "integers", float: "numbers", str: "strings"}


def expected(annotation: Any) -> str:
    """What a field of ``annotation`` takes, in words: "an integer", "a list of strings or
    null"."""
    kind, optional = _unwrap(annotation)
    origin = typing.get_origin(kind) or kind
    if origin in (list, tuple):
        element = (typing.get_args(kind) or (Any,))[0]
        words = "a list" + (f" of {_PLURAL_WORDS[element]}" if element in _PLURAL_WORDS else "")
    else:
        words = _KIND_WORDS.get(kind, "a value")
    return words + (" or null" if optional else "")


def check_type(where: str, value: Any, annotation: Any) -> Any:
    """``value`` checked against a field annotation (bool is not an int, a list is not a
    number, an int is a float, None only for Optional, a list's elements each); returns it
    with numbers read as the annotation says (an int given for a float is a float)."""
    kind, optional = _unwrap(annotation)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: expected {_KIND_WORDS.get(kind, 'a value')}, got None")
    origin = typing.get_origin(kind) or kind
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {shown(value)}")
        args = typing.get_args(kind)
        element = args[0] if args else Any
        return [_typed(where, v, element) for v in value]
    if isinstance(value, (list, dict)) and kind in _KIND_WORDS:
        raise ConfigError(f"{where}: expected {_KIND_WORDS[kind]}, got {shown(value)}")
    return _typed(where, value, kind)


def allowed(meta: Mapping[str, Any]) -> str:
    """The declared range in words: ">= 1", "> 0", "in [0, 1)", ""."""
    low = ("[", meta["min"]) if "min" in meta else ("(", meta["gt"]) if "gt" in meta else None
    high = ("]", meta["max"]) if "max" in meta else (")", meta["lt"]) if "lt" in meta else None
    if low and high:
        return f"in {low[0]}{low[1]}, {high[1]}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {low[1]}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {high[1]}"
    return ""


def _in_range(value: Any, meta: Mapping[str, Any]) -> bool:
    return not (("min" in meta and value < meta["min"])
                or ("gt" in meta and value <= meta["gt"])
                or ("max" in meta and value > meta["max"])
                or ("lt" in meta and value >= meta["lt"]))


def check_range(where: str, value: Any, meta: Mapping[str, Any]) -> None:
    """Refuse a non-finite float (unless ``finite=False``), a number outside the declared
    bounds, a value outside ``choices``; each element of a list alike."""
    for item in value if isinstance(value, list) else [value]:
        if item is None or isinstance(item, bool):
            continue
        if "choices" in meta and meta["choices"] and item not in meta["choices"]:
            raise ConfigError(f"{where} must be one of {', '.join(map(str, meta['choices']))}, "
                             f"got {shown(item)}")
        if not isinstance(item, (int, float)):
            continue
        if isinstance(item, float) and not math.isfinite(item):
            if meta.get("finite", True):
                bounds = allowed(meta)
                raise ConfigError(f"{where} must be a finite number{' ' + bounds if bounds else ''}"
                                 f", got {item}")
            continue
        if not _in_range(item, meta):
            raise ConfigError(f"{where} must be {allowed(meta)}, got {item}")


def check_value(where: str, value: Any, annotation: Any, meta: Mapping[str, Any]) -> Any:
    """Type, then finiteness, bounds and choices: the value as the field takes it."""
    value = check_type(where, value, annotation)
    check_range(where, value, meta)
    return value


def check_fields(config: Any) -> None:
    """Finiteness, bounds and choices of every field of a dataclass instance, each named by
    its flag (metadata ``flag``, else ``--field-name``)."""
    for field in dataclasses.fields(config):
        check_range(flag_of(field), getattr(config, field.name), field.metadata)
