"""Command-line flags generated from the config dataclasses, with YAML files underneath.

Precedence: dataclass defaults < ``--model-preset`` sizes < ``--config FILE.yaml`` < flags.
A field's flag is its metadata ``flag`` (Megatron-LM's name) or ``--field-name``; a field
with metadata ``cli=False`` (state the program sets, such as the built vocabulary size) has
no flag but is kept in the saved YAML. Metadata ``const`` makes the flag a switch that
stores that value (Megatron-LM's store_true/store_false flags, e.g. ``--disable-bias-linear``
storing False), ``switches`` maps more flags to the value each stores, ``aliases`` gives
other spellings. No flag may be abbreviated.

The tools (``tools/*.py``) get their flags the same way from their config dataclasses
(``tool_parser``): a field without a default is a required flag, a ``bool`` field that
defaults to False is a switch, metadata ``positional=True`` makes a positional argument,
``group`` an argument group, ``exclusive`` a mutually exclusive group, ``metavar`` the
placeholder; the help text is metadata ``help`` or else the field's docstring, followed by
its default (metadata ``default_help`` words it when the value alone says too little).

Every value is checked where it enters, by ``config_values``: a flag after argparse has
converted it (a float must be finite; metadata ``min``, ``gt``, ``max``, ``lt`` bound it),
a ``--config`` value against its field's type as well, named by its key. The YAML file
itself is bounded: ``MAX_CONFIG_BYTES``, and ``MAX_CONFIG_NODES`` after alias expansion.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any, Dict, Mapping, Sequence, Tuple, Type

import yaml

from megatron_jreg import config_values

Sections = Mapping[str, Type]


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _base_type(annotation) -> Tuple[type, bool]:
    """(element type, is_list) of an annotation such as Optional[int] or list[str]."""
    if isinstance(annotation, str):
        annotation = eval(annotation, vars(typing))  # noqa: S307 - annotations of our own code
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        return (args[0] if args else str), True
    return annotation, False


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every entry point: errors are one line naming the problem and the fix
    (no usage block, no trailer), exit status 2; no abbreviated flags (as Megatron-LM)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        """Parse, then check each field's value as its metadata says (``config_values``):
        argparse converts a flag to int or float, and float("inf") or -1 would go through."""
        namespace, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            check = getattr(action, "value_check", None)
            if check is None or not hasattr(namespace, action.dest):
                continue
            value = getattr(namespace, action.dest)
            if value is action.default:  # the program's own default, not a user's value
                continue
            try:
                config_values.check_range(check[0], value, check[1])
            except ValueError as err:
                self.error(str(err))
        return namespace, extras


class HelpFormatter(argparse.HelpFormatter):
    """Ends an option's help with its default when the default says something: not for a
    required flag, a switch that is off, or a value that is absent (None or empty)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = getattr(action, "default_help", None)
        if shown is None:
            if (action.required or not action.option_strings or "%(default)" in text
                    or default is None or default is False or default is argparse.SUPPRESS
                    or default == []):
                return text
            shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        shown = str(shown).replace("%", "%%")
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def field_docs(cls: Type) -> Dict[str, str]:
    """The docstring under each field of a dataclass (and its dataclass bases), one line."""
    docs: Dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a frozen or generated class): no docs
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                text = " ".join(inspect.cleandoc(after.value.value).split())
                docs[node.target.id] = text.replace("``", "")
    return docs


def _field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def tool_parser(sections: Mapping[str | None, Type], *, prog: str | None = None,
                description: str = "", epilog: str | None = None) -> ArgumentParser:
    """The parser of a tool: a flag per field of each dataclass, its defaults and required
    flags as the dataclass says. A section's fields go in an argument group titled by its
    key (None: the general options) unless a field's metadata ``group`` names another;
    each field's value lands under its own name (``vars(args)[field.name]``)."""
    parser = ArgumentParser(prog=prog, description=description, epilog=epilog,
                            formatter_class=HelpFormatter)
    groups: Dict[Any, Any] = {}
    seen: Dict[str, str] = {}
    for section, cls in sections.items():
        add_fields(parser, cls, section, groups=groups, seen=seen)
    return parser


def add_fields(container: Any, cls: Type, title: str | None = None, *,
               groups: Dict[Any, Any] | None = None, seen: Dict[str, str] | None = None) -> None:
    """Add a flag per field of ``cls`` to ``container``: to a parser, in the argument group
    ``title`` (None: the parser's options) or the one a field's ``group`` names; to an
    argument group, all in that group (argparse does not nest groups)."""
    groups = {} if groups is None else groups
    seen = {} if seen is None else seen
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if not field.init or field.name.startswith("_") or meta.get("cli") is False:
            continue
        positional = bool(meta.get("positional"))
        flag = field.name if positional else _flag(field)
        for name in (flag, field.name):
            if name in seen and seen[name] != f"{title}.{field.name}":
                raise ValueError(f"{name} defined by both {seen[name]} and {title}.{field.name}")
            seen[name] = f"{title}.{field.name}"
        group_title = meta.get("group", title)
        if not isinstance(container, argparse.ArgumentParser):  # a group: no nesting
            group_title = None
        if group_title is not None and group_title not in groups:
            groups[group_title] = container.add_argument_group(group_title)
        target = container if group_title is None else groups[group_title]
        if "exclusive" in meta:
            key = (group_title, meta["exclusive"])
            if key not in groups:
                groups[key] = target.add_mutually_exclusive_group()
            target = groups[key]
        kind, is_list = _base_type(hints[field.name])
        default = _field_default(field)
        kwargs: Dict[str, Any] = {"help": (meta.get("help") or docs.get(field.name, ""))
                                  .replace("%", "%%")}
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        if "action" in meta:
            kwargs["action"] = meta["action"]
        elif kind is bool:
            kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            kwargs.update(type=kind, choices=meta.get("choices"))
            if is_list or "nargs" in meta:
                kwargs["nargs"] = meta.get("nargs", "+")
        if default is not dataclasses.MISSING:
            kwargs["default"] = default
        elif not positional:
            kwargs["required"] = True
        if positional:
            action = target.add_argument(flag, **kwargs)
        else:
            action = target.add_argument(flag, *meta.get("aliases", ()), dest=field.name, **kwargs)
        action.default_help = meta.get("default_help")
        action.value_check = (flag, meta)


def tool_values(sections: Mapping[str | None, Type], argv: Sequence[str] | None = None,
                **parser_kwargs: Any) -> Dict[str | None, Dict[str, Any]]:
    """Parse a tool's flags into keyword arguments per section; the caller builds the
    configs, so each tool keeps its own handling of their validation errors."""
    args = vars(tool_parser(sections, **parser_kwargs).parse_args(argv))
    return {s: {f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args}
            for s, cls in sections.items()}


def build_parser(sections: Sections, description: str = "") -> argparse.ArgumentParser:
    parser = ArgumentParser(description=description, argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", dest="_config_file", metavar="FILE.yaml",
                        help="YAML file of settings (sections or flat keys); flags override it")
    seen: Dict[str, str] = {}
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if not field.init or field.name.startswith("_") or field.metadata.get("cli") is False:
                continue
            flag = _flag(field)
            if flag in seen:
                raise ValueError(f"flag {flag} defined by both {seen[flag]} and {section}.{field.name}")
            seen[flag] = f"{section}.{field.name}"
            dest = f"{section}.{field.name}"
            metavar = field.name.upper()
            help_text = field.metadata.get("help", "").replace("%", "%%")  # argparse formats it
            kind, is_list = _base_type(hints[field.name])
            for switch, const in field.metadata.get("switches", {}).items():
                # another flag that stores one value (Megatron-LM's older spellings)
                group.add_argument(switch, dest=dest, action="store_const", const=const,
                                   help=f"same as {flag} {const}")
            if "const" in field.metadata:  # a switch storing one value (Megatron-LM's store_true)
                group.add_argument(flag, *field.metadata.get("aliases", ()), dest=dest,
                                   action="store_const", const=field.metadata["const"],
                                   help=help_text)
            elif kind is bool and flag.startswith("--no-"):  # already a negation: a plain switch
                group.add_argument(flag, dest=dest, action="store_const", const=True, help=help_text)
            elif kind is bool:  # --flag / --no-flag
                group.add_argument(flag, *field.metadata.get("aliases", ()), dest=dest,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            elif is_list or field.metadata.get("nargs"):
                action = group.add_argument(flag, *field.metadata.get("aliases", ()), dest=dest,
                                            nargs=field.metadata.get("nargs", "+"), type=kind,
                                            help=help_text, metavar=metavar)
                action.value_check = (flag, field.metadata)
            else:
                action = group.add_argument(flag, *field.metadata.get("aliases", ()), dest=dest,
                                            type=kind, help=help_text, metavar=metavar,
                                            choices=field.metadata.get("choices"))
                action.value_check = (flag, field.metadata)
    return parser


# A settings file is a few KiB: one near this size is the wrong file (a dataset, a log).
MAX_CONFIG_BYTES = 1 << 20
# Values after expanding YAML aliases: a "billion laughs" file (aliases of aliases) is
# refused from its node graph, before any of it is built or walked.
MAX_CONFIG_NODES = 100_000


def _expanded_size(node: yaml.Node, sizes: Dict[int, float]) -> float:
    """Values in ``node`` with every alias expanded; shared nodes are counted once per use
    but computed once, and a node that contains itself is infinite."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = float("inf")  # until done: a cycle back to it is endless
    if isinstance(node, yaml.MappingNode):
        keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
        twice = sorted({k for k in keys if keys.count(k) > 1})
        if twice:  # PyYAML would keep the last one silently
            raise ValueError(f"{twice[0]} is set twice; keep one")
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(v, sizes) for v in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def _load_settings(path: str) -> Any:
    """The YAML of ``--config``, bounded in bytes and in alias expansion."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"--config {path}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a settings "
                         "file is a few KiB: pass the right file")
    loader = yaml.SafeLoader(raw)
    try:
        node = loader.get_single_node()
        try:
            size = 0 if node is None else _expanded_size(node, {})
        except ValueError as err:
            raise ValueError(f"--config {path}: {err}") from None
        if size > MAX_CONFIG_NODES:
            raise ValueError(f"--config {path}: its aliases expand to more than "
                             f"{MAX_CONFIG_NODES} values; write the settings out")
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(err).split())})") from None
    except RecursionError:
        raise ValueError(f"--config {path}: nested too deeply to be a settings file") from None
    finally:
        loader.dispose()


def _from_yaml(path: str, sections: Sections) -> Dict[str, Dict[str, Any]]:
    data = _load_settings(path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings")
    out: Dict[str, Dict[str, Any]] = {s: {} for s in sections}
    fields = {s: {f.name: f for f in dataclasses.fields(cls)} for s, cls in sections.items()}
    hints = {s: typing.get_type_hints(cls) for s, cls in sections.items()}
    owner = {name: s for s in sections for name in fields[s]}

    set_by: Dict[Tuple[str, str], str] = {}

    def take(section: str, name: str, value: Any, where: str) -> None:
        key = where.split(": ", 1)[1]
        if (section, name) in set_by:  # a flat key and its sectioned twin, or two spellings
            raise ValueError(f"--config {path}: {section}.{name} is set twice ({set_by[section, name]} "
                             f"and {key}); keep one")
        set_by[section, name] = key
        # the check a flag gets from argparse and its metadata, named by the key
        out[section][name] = config_values.check_value(
            where, value, hints[section][name], fields[section][name].metadata)

    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            for name, v in value.items():
                if name not in fields[key]:
                    raise ValueError(f"--config {path}: unknown setting {key}.{name}")
                take(key, name, v, f"--config {path}: {key}.{name}")
        else:
            name = str(key).replace("-", "_").lstrip("_")
            if name not in owner:
                raise ValueError(f"--config {path}: unknown setting {key!r}")
            take(owner[name], name, value, f"--config {path}: {key}")
    return out


def parse(sections: Sections, argv: Sequence[str] | None = None, description: str = "",
          build: Mapping[str, Any] | None = None,
          given: Dict[str, Dict[str, Any]] | None = None,
          resolve: Any = None) -> Dict[str, Any]:
    """Parse flags (and ``--config``) into one config object per section.

    ``build`` may map a section to a callable(values) that constructs it (presets).
    ``given``, when a dict, receives the settings as given (flags over YAML, before any
    default), per section: what a caller needs to tell "set" from "left at its default".
    ``resolve``, when given, may rewrite the settings (a callable(values), before any
    section is built; the checkpoint's architecture of --use-checkpoint-args).
    Dataclass validation errors become argparse errors: one line, exit code 2.
    """
    parser = build_parser(sections, description)
    args = vars(parser.parse_args(argv))
    values: Dict[str, Dict[str, Any]] = {s: {} for s in sections}
    try:
        if "_config_file" in args:
            values = _from_yaml(args.pop("_config_file"), sections)
        for dest, value in args.items():
            section, name = dest.split(".", 1)
            values[section][name] = value
        if given is not None:
            given.update({section: dict(v) for section, v in values.items()})
        if resolve is not None:
            resolve(values)
        configs = {}
        for section, cls in sections.items():
            maker = (build or {}).get(section, lambda v, cls=cls: cls(**v))
            configs[section] = maker(values[section])
        return configs
    except (ValueError, TypeError) as err:
        parser.error(str(err))


def to_yaml(configs: Mapping[str, Any]) -> str:
    return yaml.safe_dump({k: dataclasses.asdict(v) for k, v in configs.items()}, sort_keys=False)


def from_yaml_text(text: str, sections: Sections) -> Dict[str, Any]:
    data = yaml.safe_load(text) or {}
    return {s: cls(**data.get(s, {})) for s, cls in sections.items()}
