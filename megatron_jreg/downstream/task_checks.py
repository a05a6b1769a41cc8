"""What lm-eval passes over in silence in a local task, said in one line before any model.

Called by :mod:`megatron_jreg.downstream.harness`: :func:`skipped_yaml` names a YAML of
``--include-path`` that lm-eval's index skipped (it does not parse, or names no task; lm-eval
logs a debug line only), :func:`check_duplicates` refuses a task two YAMLs define (lm-eval keeps
the first), and :func:`check_targets` refuses a multiple-choice task whose targets do not index
its choices (lm-eval scores every document 0 and reports accuracy 0.00 as a result).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from megatron_jreg.errors import InputError

DOCS_CHECKED = 5
_IGNORED_DIRS = {"__pycache__", ".ipynb_checkpoints"}  # as lm-eval's index


def _loader():
    # lm-eval's YAMLs may hold ``!function module.fn`` tags: any tag's text is kept, nothing
    # is imported
    import yaml

    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        pass

    def any_tag(loader, suffix, node):
        if isinstance(node, yaml.ScalarNode):
            return loader.construct_scalar(node)
        if isinstance(node, yaml.SequenceNode):
            return loader.construct_sequence(node)
        return loader.construct_mapping(node)

    Loader.add_multi_constructor("!", any_tag)
    return Loader


def _yamls(include_path: List[str]) -> Iterator[Tuple[str, object, Optional[str]]]:
    """(path, parsed config or None, parse problem or None) of each YAML, in lm-eval's order."""
    import yaml

    loader = _loader()
    for root in include_path:
        paths = sorted((p for p in Path(root).glob("**/*.yaml")
                        if not any(part in _IGNORED_DIRS for part in p.parts)),
                       key=lambda p: p.as_posix())
        for path in paths:
            try:
                with open(path, encoding="utf-8") as f:
                    yield str(path), yaml.load(f, Loader=loader), None
            except yaml.YAMLError as err:
                yield str(path), None, f"not valid YAML ({_yaml_problem(err)})"
            except (OSError, UnicodeDecodeError) as err:
                yield str(path), None, f"cannot be read ({err})"


def _at(mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_problem(err) -> str:
    """'line 9, column 16: while parsing a flow sequence, did not find expected ',' or ']'
    at line 10, column 14': where the construct began (the line to fix) and where the
    parser gave up."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark, context = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    if context is not None and mark is not None and context.line != mark.line:
        return f"{_at(context)}: {err.context}, {problem} at {_at(mark)}"
    return f"{_at(mark)}: {problem}" if mark is not None else problem


def skipped_yaml(include_path: Optional[List[str]], unknown: List[str]) -> Optional[str]:
    """Why lm-eval may have skipped a local task: the first YAML of ``include_path`` that
    does not parse, else the first that names no task (a file another one includes is a
    base, not a task); None when every YAML names a task or a group."""
    if not include_path:
        return None
    parsed = list(_yamls(include_path))
    for path, _, problem in parsed:
        if problem:
            return f"lm-eval skipped {path} of --include-path: it is {problem}; fix that file"
    included = {os.path.basename(str(inc)) for _, cfg, _ in parsed if isinstance(cfg, dict)
                for inc in (cfg.get("include") if isinstance(cfg.get("include"), list)
                            else [cfg.get("include")]) if inc}
    named = f"task: {unknown[0]}" if len(unknown) == 1 else "task: <name>"
    for path, cfg, _ in parsed:
        if os.path.basename(path) in included:
            continue
        if not isinstance(cfg, dict):
            return (f"lm-eval skipped {path} of --include-path: it holds no mapping of task "
                    "settings; write the task's settings there")
        if not any(key in cfg for key in ("task", "group", "class", "include")):
            return (f"lm-eval skipped {path} of --include-path: it has no `task:` line; add "
                    f"`{named}` to it")
    return None


def check_duplicates(include_path: Optional[List[str]], names: List[str]) -> None:
    """Refuse a task of ``names`` that two YAMLs of ``include_path`` define."""
    if not include_path:
        return
    files: Dict[str, List[str]] = {}
    for path, cfg, _ in _yamls(include_path):
        if isinstance(cfg, dict) and "group" not in cfg and isinstance(cfg.get("task"), str):
            files.setdefault(cfg["task"], []).append(path)
    for name in names:
        if len(files.get(name, ())) > 1:
            first, second = files[name][:2]
            raise InputError(f"task {name} is defined twice in --include-path: {first} and "
                             f"{second} (lm-eval would take the first and skip the other); "
                             "rename one task or remove one file")


def _shown(value, width: int = 120) -> str:
    text = getattr(value, "__name__", None) if callable(value) else None
    text = text or repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def check_targets(name: str, task) -> None:
    """A multiple-choice task's first documents must each have a target that indexes, or is
    one of, its choices; lm-eval scores a document without one as wrong, with a warning."""
    if getattr(task, "OUTPUT_TYPE", None) != "multiple_choice" or getattr(
            task, "multiple_input", False):
        return  # a multiple-input task's gold comes from doc_to_text: lm-eval checks nothing
    config = task.config
    try:
        docs = task.eval_docs
        count = min(DOCS_CHECKED, len(docs))
    except Exception:  # noqa: BLE001 - no split to evaluate: lm-eval says so when it runs
        return
    for i in range(count):
        doc = docs[i]
        key = "doc_to_choice"
        try:
            choices = task.doc_to_choice(doc)
            key = "doc_to_target"
            gold = task.doc_to_target(doc)
        except Exception as err:  # noqa: BLE001 - a template or function of the YAML failed
            raise InputError(
                f"task {name}: {key}: {_shown(getattr(config, key, None))} fails on document "
                f"{i} {_shown(doc)} ({type(err).__name__}: {str(err)[:160]}); check the "
                "task's YAML") from None
        golds = gold if isinstance(gold, list) else [gold]
        if isinstance(choices, (list, tuple)) and all(_valid(g, choices) for g in golds):
            continue
        what = (f"gives {len(choices)} choices" if isinstance(choices, (list, tuple))
                else f"gives {_shown(choices)}, not a list of choices")
        key, shown = config.doc_to_target, _shown(config.doc_to_target)
        fields = list(getattr(task, "features", None) or [])
        if isinstance(key, str) and key == gold and fields and key not in fields:
            # lm-eval takes a key that names no field as a template: the text itself
            shown += f" (no such field; the data's fields: {', '.join(fields)})"
        raise InputError(
            f"task {name}: doc_to_target: {shown} gives {gold!r} on "
            f"document {i} {_shown(doc)}, where doc_to_choice: {_shown(config.doc_to_choice)} "
            f"{what}; the target must be an index of the choices or one of them (lm-eval would "
            "score every such document 0): check the task's YAML and data")


def _valid(gold, choices) -> bool:
    if isinstance(gold, bool):
        return False
    if isinstance(gold, int):
        return 0 <= gold < len(choices)
    return isinstance(gold, str) and gold in choices
