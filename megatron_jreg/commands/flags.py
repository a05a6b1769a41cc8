"""Command-line flags generated from config dataclasses, one generator for the trainer and
every tool (the field metadata vocabulary is ``config.schema``'s).

The trainer's parser (:func:`parse`) keeps only the flags given, under ``section.field``, so
"set" can be told from "left at its default"; precedence: defaults < ``--model-preset`` <
``--config FILE.yaml`` < flags. A tool's parser (:func:`tool_parser`) holds every field's value
under its own name. Values are checked where they enter (``config.values``).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Dict, Mapping, Sequence, Type

from megatron_jreg.config import values as config_values
from megatron_jreg.config import yaml_settings
from megatron_jreg.config.schema import base_type, field_default, field_docs, flag_of

# the saved run config's YAML, beside the command line it was parsed from
from megatron_jreg.config.yaml_settings import from_yaml_text, to_yaml  # noqa: F401

Sections = Mapping[str, Type]


class ArgumentParser(argparse.ArgumentParser):
    """The parser of every entry point: errors are one line naming the problem and the fix
    (no usage block, no trailer), exit status 2; no abbreviated flags (as Megatron-LM)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        """Parse, then check each field's value as its metadata says (``config.values``):
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


def _claim(seen: Dict[str, str], field: dataclasses.Field, flag: str, title: Any,
           given_only: bool) -> None:
    """Refuse a flag (or, for a tool, a destination) that two fields define."""
    owner = f"{title}.{field.name}"
    if given_only:
        if flag in seen:
            raise ValueError(f"flag {flag} defined by both {seen[flag]} and {owner}")
        seen[flag] = owner
        return
    for name in (flag, field.name):
        if name in seen and seen[name] != owner:
            raise ValueError(f"{name} defined by both {seen[name]} and {owner}")
        seen[name] = owner


# A field's flag is ``schema.flag_of``'s (no flag may be abbreviated); metadata ``cli=False``
# gives none (state the program sets, kept in the saved YAML). ``const`` makes a switch storing
# that value (Megatron-LM's store_true/store_false, e.g. --disable-bias-linear storing False),
# ``switches`` maps more flags to the value each stores, ``aliases`` gives other spellings. In
# a tool, a field without a default is a required flag and a bool defaulting to False a switch;
# ``positional``, ``group``, ``exclusive`` and ``metavar`` shape the argument. The help is
# metadata ``help`` or else the field's docstring, then its default (``default_help`` words it
# when the value alone says too little).
def add_fields(container: Any, cls: Type, title: str | None = None, *,
               groups: Dict[Any, Any] | None = None, seen: Dict[str, str] | None = None,
               given_only: bool = False) -> None:
    """Add a flag per field of ``cls`` to ``container``: to a parser, in the argument group
    ``title`` (None: the parser's options) or the one a field's ``group`` names; to an
    argument group, all in that group (argparse does not nest groups).

    given_only: the trainer's form: each value lands under ``title.field`` only when given
    (no defaults, no required flags), placeholders are the field's name in capitals and a
    bool flag is ``--flag/--no-flag`` unless it is a negation already."""
    groups = {} if groups is None else groups
    seen = {} if seen is None else seen
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if not field.init or field.name.startswith("_") or meta.get("cli") is False:
            continue
        positional = bool(meta.get("positional"))
        flag = field.name if positional else flag_of(field)
        _claim(seen, field, flag, title, given_only)
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
        kind, is_list = base_type(hints[field.name])
        default = field_default(field)
        dest = f"{title}.{field.name}" if given_only else field.name
        kwargs: Dict[str, Any] = {"help": (meta.get("help") or docs.get(field.name, ""))
                                  .replace("%", "%%")}  # argparse formats it
        for switch, const in meta.get("switches", {}).items():
            # another flag that stores one value (Megatron-LM's older spellings)
            same = (flag if const else "--no-" + flag[2:]) if kind is bool else f"{flag} {const}"
            target.add_argument(switch, dest=dest, action="store_const", const=const,
                                help=f"same as {same}")
        if "metavar" in meta:
            kwargs["metavar"] = meta["metavar"]
        if "action" in meta:
            kwargs["action"] = meta["action"]
        elif "const" in meta:  # a switch storing one value (Megatron-LM's store_true)
            kwargs.update(action="store_const", const=meta["const"])
        elif kind is bool:
            plain = flag.startswith("--no-") if given_only else default is False
            if plain and given_only:  # a switch that is a negation already
                kwargs.update(action="store_const", const=True)
            elif plain:  # a switch, off by default
                kwargs["action"] = "store_true"
            else:  # --flag / --no-flag
                kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs.update(type=kind, choices=meta.get("choices"))
            if given_only:
                kwargs.setdefault("metavar", field.name.upper())
            if is_list or "nargs" in meta:
                kwargs["nargs"] = meta.get("nargs", "+")
        if not given_only:
            if default is not dataclasses.MISSING:
                kwargs["default"] = default
            elif not positional:
                kwargs["required"] = True
        if positional:
            action = target.add_argument(flag, **kwargs)
        else:
            action = target.add_argument(flag, *meta.get("aliases", ()), dest=dest, **kwargs)
        action.default_help = meta.get("default_help")
        action.value_check = (flag, meta)


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


def tool_values(sections: Mapping[str | None, Type], argv: Sequence[str] | None = None,
                **parser_kwargs: Any) -> Dict[str | None, Dict[str, Any]]:
    """Parse a tool's flags into keyword arguments per section; the caller builds the
    configs, so each tool keeps its own handling of their validation errors."""
    args = vars(tool_parser(sections, **parser_kwargs).parse_args(argv))
    return {s: {f.name: args[f.name] for f in dataclasses.fields(cls) if f.name in args}
            for s, cls in sections.items()}


def build_parser(sections: Sections, description: str = "") -> ArgumentParser:
    """The trainer's parser: ``--config`` and every section's flags, one group a section."""
    parser = ArgumentParser(description=description, argument_default=argparse.SUPPRESS,
                            formatter_class=HelpFormatter)
    parser.add_argument("--config", dest="_config_file", metavar="FILE.yaml",
                        help="YAML file of settings (sections or flat keys: a field's name or its "
                        "flag's, e.g. lam or jreg_lambda); flags override it")
    groups: Dict[Any, Any] = {}
    seen: Dict[str, str] = {}
    for section, cls in sections.items():
        groups[section] = parser.add_argument_group(section)
        add_fields(parser, cls, section, groups=groups, seen=seen, given_only=True)
    return parser


def given_values(sections: Sections, argv: Sequence[str] | None = None,
                 description: str = "") -> Dict[str, Dict[str, Any]]:
    """The trainer's settings as given, per section: ``--config``'s, then the flags over
    them; no defaults. A bad flag or settings file exits 2 with one line."""
    parser = build_parser(sections, description)
    args = vars(parser.parse_args(argv))
    try:
        values: Dict[str, Dict[str, Any]] = {s: {} for s in sections}
        if "_config_file" in args:
            values = yaml_settings.from_yaml(args.pop("_config_file"), sections)
        for dest, value in args.items():
            section, name = dest.split(".", 1)
            values[section][name] = value
        return values
    except (ValueError, TypeError) as err:
        parser.error(str(err))


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
    values = given_values(sections, argv, description)
    try:
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
        build_parser(sections, description).error(str(err))
