"""The metadata vocabulary of a config field, shared by the trainer and every tool:

``flag`` (else ``--field-name``), ``aliases``, ``positional=True``, ``cli=False`` (no flag: state
the program sets, kept in YAML); ``const`` and ``switches`` (switches storing a value),
``action``; ``choices``, ``min``/``gt``/``max``/``lt``, ``finite`` (``config.values``);
``nargs``, ``metavar``, ``help`` (else the field's docstring), ``default_help``; ``group`` and
``exclusive`` (argument groups).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Dict, Sequence, Tuple, Type

from megatron_jreg.errors import ConfigError


def flag_of(field: dataclasses.Field) -> str:
    """The flag of a field: metadata ``flag``, else ``--field-name``."""
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def option(flag: str, help_text: str, **extra) -> dict:
    """The metadata of a field with a flag and a help text (and any other metadata word)."""
    return {"flag": flag, "help": help_text, **extra}


def setting(default: Any = None, **metadata) -> Any:
    """A dataclass field with a default and metadata words (a tool's flag)."""
    return dataclasses.field(default=default, metadata=metadata)


def base_type(annotation) -> Tuple[type, bool]:
    """(element type, is_list) of an annotation such as Optional[int] or list[str]."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # noqa: S307 - annotations of our own code
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return base_type(args[0])
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        return (args[0] if args else str), True
    return annotation, False


def field_default(field: dataclasses.Field) -> Any:
    """The default of a field (its factory's value), or ``dataclasses.MISSING``."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def field_docs(cls: Type) -> Dict[str, str]:
    """The docstring under each field of a dataclass (and its dataclass bases), one line."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a generated class): no docs
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                text = " ".join(inspect.cleandoc(after.value.value).split())
                docs[node.target.id] = text.replace("``", "")
    return docs


def read_flags(cls: Type, argv: Sequence[str]) -> Dict[str, Any]:
    """The values a list of flags gives the fields of ``cls``, read as the command line
    reads them (switches, ``--flag/--no-flag``, values converted to the field's type),
    without a parser: for flag bundles of our own, such as the model presets."""
    hints = typing.get_type_hints(cls)
    readers: Dict[str, Tuple[dataclasses.Field, Any]] = {}
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if not field.init or meta.get("cli") is False:
            continue
        flag = flag_of(field)
        for name in (flag, *meta.get("aliases", ())):
            readers[name] = (field, dataclasses.MISSING)
        for switch, const in meta.get("switches", {}).items():
            readers[switch] = (field, const)
        if "const" in meta:
            readers[flag] = (field, meta["const"])
        elif base_type(hints[field.name])[0] is bool:
            readers[flag] = (field, True)
            if not flag.startswith("--no-"):
                readers["--no-" + flag[2:]] = (field, False)
    out: Dict[str, Any] = {}
    i = 0
    while i < len(argv):
        if argv[i] not in readers:
            raise ConfigError(f"{argv[i]}: not a flag of {cls.__name__}")
        field, stored = readers[argv[i]]
        i += 1
        if stored is not dataclasses.MISSING:
            out[field.name] = stored
            continue
        kind, is_list = base_type(hints[field.name])
        nargs = field.metadata.get("nargs", "+" if is_list else None)
        if nargs is None:
            out[field.name] = kind(argv[i])
            i += 1
            continue
        count = nargs if isinstance(nargs, int) else len(argv)
        taken = []
        while i < len(argv) and len(taken) < count and not argv[i].startswith("--"):
            taken.append(kind(argv[i]))
            i += 1
        out[field.name] = taken
    return out
