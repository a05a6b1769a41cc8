"""The ``--config FILE.yaml`` settings file, and the YAML of a saved run config.

The file is bounded: ``MAX_CONFIG_BYTES``, and ``MAX_CONFIG_NODES`` after alias expansion.
Its keys are sections of settings or flat field names (``-`` or ``_``), or a flag's own name
(``jreg-lambda`` for ``jreg.lam``); each value is checked
against its field's type and metadata (``config.values``), named by its key.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Dict, Mapping, Tuple, Type, Union

import yaml

from megatron_jreg.config import values
from megatron_jreg.errors import ConfigError

Sections = Mapping[str, Type]


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
            raise ConfigError(f"{twice[0]} is set twice; keep one")
        total = 1 + sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    elif isinstance(node, yaml.SequenceNode):
        total = 1 + sum(_expanded_size(v, sizes) for v in node.value)
    else:
        total = 1
    sizes[id(node)] = total
    return total


def load_settings(path: str) -> Any:
    """The YAML of ``--config``, bounded in bytes and in alias expansion."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it ({err.strerror})") from None
    return load_bounded(raw, f"--config {path}")


def load_bounded(raw: Union[bytes, str], where: str) -> Any:
    """YAML text ``raw`` (a settings file, a checkpoint's run config; ``where`` names it in
    messages) as data, refused in one line when over ``MAX_CONFIG_BYTES`` or when its
    aliases expand to over ``MAX_CONFIG_NODES`` values: the one reader of both."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", errors="replace")
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{where}: larger than {MAX_CONFIG_BYTES >> 20} MiB; a settings "
                         "file is a few KiB: pass the right file")
    loader = yaml.SafeLoader(raw)
    try:
        node = loader.get_single_node()
        try:
            size = 0 if node is None else _expanded_size(node, {})
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        if size > MAX_CONFIG_NODES:
            raise ConfigError(f"{where}: its aliases expand to more than "
                             f"{MAX_CONFIG_NODES} values; write the settings out")
        return None if node is None else loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{where}: not valid YAML ({' '.join(str(err).split())[:300]})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to be a settings file") from None
    finally:
        loader.dispose()


def from_yaml(path: str, sections: Sections) -> Dict[str, Dict[str, Any]]:
    data = load_settings(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings")
    out: Dict[str, Dict[str, Any]] = {s: {} for s in sections}
    fields = {s: {f.name: f for f in dataclasses.fields(cls)} for s, cls in sections.items()}
    hints = {s: typing.get_type_hints(cls) for s, cls in sections.items()}
    owner = {name: s for s in sections for name in fields[s]}
    # a flag's own name is a key too (jreg_lambda or jreg-lambda for jreg.lam), except a
    # switch that sets its field to False (--disable-bias-linear): true under that name
    # would mean the opposite of true under the field's, so the error names the field
    by_flag: Dict[str, Tuple[str, str]] = {}
    inverted: Dict[str, str] = {}
    for s, named in fields.items():
        for name, f in named.items():
            flag = f.metadata.get("flag")
            if not isinstance(flag, str) or not flag.startswith("--"):
                continue
            alias = flag[2:].replace("-", "_")
            if alias == name or alias in owner:
                continue
            if f.metadata.get("const") is False:
                inverted[alias] = (f"; {flag} is the key {name}: false (or {s}: {{{name}: "
                                   f"false}})")
            else:
                by_flag[alias] = (s, name)

    set_by: Dict[Tuple[str, str], str] = {}

    def take(section: str, name: str, value: Any, where: str) -> None:
        key = where.split(": ", 1)[1]
        if (section, name) in set_by:  # a flat key and its sectioned twin, or two spellings
            raise ConfigError(f"--config {path}: {section}.{name} is set twice "
                              f"({set_by[section, name]} and {key}); keep one")
        set_by[section, name] = key
        # the check a flag gets from argparse and its metadata, named by the key
        out[section][name] = values.check_value(
            where, value, hints[section][name], fields[section][name].metadata)

    for key, value in data.items():
        if key in sections and isinstance(value, dict):
            for name, v in value.items():
                if name not in fields[key]:
                    raise ConfigError(f"--config {path}: unknown setting {key}.{name}")
                take(key, name, v, f"--config {path}: {key}.{name}")
        else:
            name = str(key).replace("-", "_").lstrip("_")
            if name not in owner and name in by_flag:  # the flag's spelling (jreg-lambda)
                section, field_name = by_flag[name]
                take(section, field_name, value, f"--config {path}: {key}")
                continue
            if name not in owner:
                hint = inverted.get(name, "")
                raise ConfigError(f"--config {path}: unknown setting {key!r}{hint}")
            take(owner[name], name, value, f"--config {path}: {key}")
    return out



def to_yaml(configs: Mapping[str, Any]) -> str:
    return yaml.safe_dump({k: dataclasses.asdict(v) for k, v in configs.items()}, sort_keys=False)


def from_yaml_text(text: str, sections: Sections, where: str = "run_config.yaml") -> Dict[str, Any]:
    """The sections of a saved run config (``to_yaml``'s text), read with ``--config``'s
    bounds (:func:`load_bounded`); ``where`` names the file in messages."""
    data = load_bounded(text, where) or {}
    if not isinstance(data, dict) or not all(isinstance(data.get(s, {}), dict) for s in sections):
        raise ConfigError(f"{where}: expected a mapping of sections ({', '.join(sections)}) "
                         "of settings")
    out = {}
    for s, cls in sections.items():
        given = _checked_section(where, s, cls, data.get(s, {}))
        try:
            out[s] = cls(**given)
        except (TypeError, ValueError) as err:  # an unknown key, settings that do not go together
            raise ConfigError(f"{where}: section {s}: {str(err).splitlines()[0][:300]}") from None
    return out


def _checked_section(where: str, section: str, cls: Type,
                     given: Mapping[str, Any]) -> Dict[str, Any]:
    """``given`` (section ``section`` of the saved run config ``where``) with each known
    field's value checked as a ``--config`` key's is: its kind first (``num_layers: "4"``
    would reach the model's arithmetic as text), then its bounds. An unknown key is left to
    the section's constructor, which names it."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    fix = (f"{os.path.basename(where)} was edited or damaged: restore the one saved with "
           "these weights")
    out = dict(given)
    for name, value in given.items():
        if name not in fields:
            continue
        key = f"{where}: {section}.{name}"
        try:
            out[name] = values.check_type(key, value, hints[name])
        except ConfigError:
            raise ConfigError(f"{key} is {values.shown(value)}, not "
                              f"{values.expected(hints[name])}; {fix}") from None
        try:
            values.check_range(key, out[name], fields[name].metadata)
        except ConfigError as err:
            raise ConfigError(f"{err}; {fix}") from None
    return out
