"""A demo JSONL corpus of real English text, harvested offline from the Python stdlib.

Docstrings of stdlib modules, classes and functions are read with ``ast`` (never imported:
some stdlib modules act on import, e.g. ``antigravity`` opens a browser), walked in sorted
path order and deduplicated, so the corpus is identical for a given Python version.
"""

from __future__ import annotations

import ast
import json
import os
import sysconfig
import tokenize
from dataclasses import dataclass, field
from typing import Iterator

# Directories whose docstrings are test scaffolding or vendored code, not prose.
_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__",
                        "idle_test", "lib2to3", "ensurepip", "turtledemo"})


@dataclass(kw_only=True)
class DemoCorpusConfig:
    """What to harvest and where to write it."""

    output: str
    """The JSONL file to write, one ``{"text": ..., "source": ...}`` object per line."""
    max_docs: int | None = None
    """Stop after this many documents (None: no limit)."""
    max_mb: float | None = None
    """Stop once this many MB of text are written (None: no limit)."""
    min_chars: int = 200
    """Shorter docstrings are dropped: one-liners teach a tokenizer little."""
    stdlib_dir: str | None = field(default=None, metadata={"cli": False})
    """The stdlib to walk; None means this interpreter's."""

    def __post_init__(self) -> None:
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"--max-docs must be at least 1, got {self.max_docs}")
        if self.max_mb is not None and self.max_mb <= 0:
            raise ValueError(f"--max-mb must be positive, got {self.max_mb}")
        if self.min_chars < 1:
            raise ValueError(f"--min-chars must be at least 1, got {self.min_chars}")


def _stdlib_sources(stdlib_dir: str) -> Iterator[tuple[str, str]]:
    """(dotted module name, path) of every stdlib .py file, in sorted order."""
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            rel = os.path.relpath(path, stdlib_dir)[: -len(".py")]
            module = rel.replace(os.sep, ".").removesuffix(".__init__")
            yield module, path


def _docstrings(module: str, path: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) for the module and each class/function, in source order."""
    try:
        with tokenize.open(path) as f:  # honours the file's coding cookie
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return  # e.g. deliberately broken test data; nothing to harvest

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    yield name, doc
                yield from walk(child, name)

    doc = ast.get_docstring(tree)
    if doc:
        yield module, doc
    yield from walk(tree, module)


def iter_demo_documents(config: DemoCorpusConfig) -> Iterator[dict[str, str]]:
    """Documents ``{"text", "source"}`` in deterministic order, deduplicated by text."""
    stdlib_dir = config.stdlib_dir or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(stdlib_dir):
        raise FileNotFoundError(f"demo corpus: stdlib directory {stdlib_dir!r} does not exist")
    seen: set[int] = set()
    for module, path in _stdlib_sources(stdlib_dir):
        for source, text in _docstrings(module, path):
            text = text.strip()
            if len(text) < config.min_chars:
                continue
            key = hash(text)  # str hashes are salted per process, but only compared in-process
            if key in seen:
                continue
            seen.add(key)
            yield {"text": text, "source": source}


def write_demo_corpus(config: DemoCorpusConfig) -> tuple[int, int]:
    """Write the corpus; returns (documents, bytes). Writes a temp file, then renames."""
    out_dir = os.path.dirname(os.path.abspath(config.output))
    if not os.path.isdir(out_dir):
        raise FileNotFoundError(
            f"demo corpus: output directory {out_dir!r} does not exist; create it first"
        )
    max_bytes = None if config.max_mb is None else int(config.max_mb * 1e6)
    tmp = f"{config.output}.tmp-{os.getpid()}"
    docs = written = 0
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            for doc in iter_demo_documents(config):
                if config.max_docs is not None and docs >= config.max_docs:
                    break
                if max_bytes is not None and written >= max_bytes:
                    break
                line = json.dumps(doc, ensure_ascii=False) + "\n"
                f.write(line)
                docs += 1
                written += len(line.encode("utf-8"))
        os.replace(tmp, config.output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return docs, written
