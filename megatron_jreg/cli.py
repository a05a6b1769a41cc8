"""Command-line flags generated from the config dataclasses, with YAML files underneath.

Precedence: dataclass defaults < ``--model-preset`` sizes < ``--config FILE.yaml`` < flags.
A field's flag is its metadata ``flag`` (Megatron-LM's name) or ``--field-name``; a field
with metadata ``cli=False`` (state the program sets, such as the built vocabulary size) has
no flag but is kept in the saved YAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict, Mapping, Sequence, Tuple, Type

import yaml

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
            if kind is bool and flag.startswith("--no-"):  # already a negation: a plain switch
                group.add_argument(flag, dest=dest, action="store_const", const=True, help=help_text)
            elif kind is bool:  # --flag / --no-flag
                group.add_argument(flag, *field.metadata.get("aliases", ()), dest=dest,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            elif is_list or field.metadata.get("nargs"):
                group.add_argument(flag, dest=dest, nargs=field.metadata.get("nargs", "+"), type=kind,
                                   help=help_text, metavar=metavar)
            else:
                group.add_argument(flag, dest=dest, type=kind, help=help_text, metavar=metavar,
                                   choices=field.metadata.get("choices"))
    return parser


def _from_yaml(path: str, sections: Sections) -> Dict[str, Dict[str, Any]]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as err:
        raise ValueError(f"--config {path}: cannot read it ({err.strerror})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings")
    out: Dict[str, Dict[str, Any]] = {s: {} for s in sections}
    owner = {f.name: s for s, cls in sections.items() for f in dataclasses.fields(cls)}
    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            names = {f.name for f in dataclasses.fields(sections[key])}
            for name, v in value.items():
                if name not in names:
                    raise ValueError(f"--config {path}: unknown setting {key}.{name}")
                out[key][name] = v
        else:
            name = key.replace("-", "_").lstrip("_")
            if name not in owner:
                raise ValueError(f"--config {path}: unknown setting {key!r}")
            out[owner[name]][name] = value
    return out


def parse(sections: Sections, argv: Sequence[str] | None = None, description: str = "",
          build: Mapping[str, Any] | None = None) -> Dict[str, Any]:
    """Parse flags (and ``--config``) into one config object per section.

    ``build`` may map a section to a callable(values) that constructs it (presets).
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
