"""Demo JSONL data made offline: English text from the Python stdlib, and chat conversations.

Docstrings of stdlib modules, classes and functions are read with ``ast`` (never imported:
some stdlib modules act on import, e.g. ``antigravity`` opens a browser), walked in sorted
path order and deduplicated, so the corpus is identical for a given Python version.

With ``chat`` the file holds generated conversations instead (``{"messages": [...]}``, the
input of ``preprocess_data.py --sft``): small tasks with checkable answers (arithmetic,
spelling, counting, a few facts), an optional system message and 1-3 user/assistant turns,
drawn from a seeded generator, so the file is the same on every machine.
"""

from __future__ import annotations

import ast
import itertools
import json
import os
import random
import sysconfig
import tokenize
from dataclasses import dataclass, field
from typing import Iterator

from megatron_jreg.atomic_write import check_output_path, temp_marker
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import output_lock

# Directories whose docstrings are test scaffolding or vendored code, not prose.
_SKIP_DIRS = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__",
                        "idle_test", "lib2to3", "ensurepip", "turtledemo"})


@dataclass(kw_only=True)
class DemoCorpusConfig:
    """What to harvest and where to write it."""

    output: str
    """The JSONL file to write, one ``{"text": ..., "source": ...}`` object per line
    (``{"messages": [...], "source": ...}`` with --chat)."""
    max_docs: int | None = None
    """Stop after this many documents (None: no limit; 500 conversations with --chat)."""
    skip_docs: int = 0
    """Leave out the first this many documents: ``--max-docs N`` and ``--skip-docs N`` give
    two corpora without a document in common (held-out text)."""
    max_mb: float | None = None
    """Stop once this many MB of text are written (None: no limit)."""
    min_chars: int = 200
    """Shorter docstrings are dropped: one-liners teach a tokenizer little."""
    stdlib_dir: str | None = field(default=None, metadata={"cli": False})
    """The stdlib to walk; None means this interpreter's."""
    chat: bool = False
    """Write generated chat conversations ({"messages": [...]}, 500 unless --max-docs says
    otherwise) for preprocess_data.py --sft, instead of docstrings."""
    overwrite: bool = False
    """Replace an existing --output (a corpus tokenizers and datasets were built from)."""

    def __post_init__(self) -> None:
        if self.max_docs is not None and self.max_docs < 1:
            raise InputError(f"--max-docs must be at least 1, got {self.max_docs}")
        if self.max_mb is not None and self.max_mb <= 0:
            raise InputError(f"--max-mb must be positive, got {self.max_mb}")
        if self.skip_docs < 0:
            raise InputError(f"--skip-docs must be >= 0, got {self.skip_docs}")
        if self.min_chars < 1:
            raise InputError(f"--min-chars must be at least 1, got {self.min_chars}")


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


# -- chat conversations ------------------------------------------------------------------------
DEMO_CHATS = 500
# Byte-tokenizer tokens a conversation may take in the tulu template: the tiny SFT run
# trains at 256 positions, so no demo conversation is cut.
CHAT_BUDGET = 256
_TULU_OVERHEAD = {"system": 12, "user": 10, "assistant": 16}  # header, newline, EOS

_SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a friendly tutor.",
            "Give short, exact answers.")
_WORDS = ("apple", "river", "garden", "pencil", "window", "orange", "rabbit", "planet",
          "silver", "candle", "forest", "market", "bridge", "yellow", "summer", "winter",
          "letter", "number", "castle", "dragon", "basket", "pocket", "mirror", "ladder")
_OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "fast": "slow", "early": "late",
              "open": "closed", "light": "dark", "happy": "sad", "full": "empty", "old": "new"}
_SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa",
           "owl": "hoo", "horse": "neigh", "frog": "ribbit"}
_COLOURS = {"the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow",
            "coal": "black", "a tomato": "red", "an orange": "orange", "a plum": "purple"}
_GREETINGS = ("Hello!", "Hi there.", "Good morning!", "Hey, are you there?")


def _arithmetic(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    op = rng.choice("+-x")
    if op == "+":
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", a + b
    if op == "-":
        a, b = max(a, b), min(a, b)
        return f"What is {a} - {b}?", f"{a} - {b} = {a - b}.", a - b
    a, b = a % 12 + 1, b % 12 + 1
    return f"What is {a} times {b}?", f"{a} times {b} is {a * b}.", a * b


def _word_task(rng: random.Random) -> tuple[str, str]:
    w = rng.choice(_WORDS)
    kind = rng.randrange(4)
    if kind == 0:
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 1:
        return f"How many letters are in '{w}'?", f"'{w}' has {len(w)} letters."
    if kind == 2:
        return f"Write '{w}' in capital letters.", w.upper()
    return f"What is the first letter of '{w}'?", f"The first letter of '{w}' is '{w[0]}'."


def _fact(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    if kind == 0:
        animal = rng.choice(sorted(_SOUNDS))
        return f"What sound does a {animal} make?", f"A {animal} says {_SOUNDS[animal]}."
    if kind == 1:
        thing = rng.choice(sorted(_COLOURS))
        return f"What colour is {thing}?", f"{thing[0].upper()}{thing[1:]} is {_COLOURS[thing]}."
    word = rng.choice(sorted(_OPPOSITES))
    return (f"What is the opposite of '{word}'?",
            f"The opposite of '{word}' is '{_OPPOSITES[word]}'.")


def _counting(rng: random.Random) -> tuple[str, str]:
    a = rng.randint(1, 40)
    if rng.random() < 0.5:
        return f"What number comes after {a}?", f"{a + 1} comes after {a}."
    b = a + rng.randint(2, 5)
    return f"Count from {a} to {b}.", ", ".join(str(n) for n in range(a, b + 1)) + "."


def _turns(rng: random.Random) -> Iterator[tuple[str, str]]:
    """(user, assistant) pairs of one conversation; follow-ups may use the last answer."""
    result = None
    while True:
        kind = rng.randrange(6)
        if kind == 0 and result is not None:
            c = rng.randint(1, 20)
            yield f"And if you add {c} to that?", f"{result} + {c} = {result + c}."
            result += c
            continue
        if kind == 1 and result is None:
            yield rng.choice(_GREETINGS), "Hello! How can I help you today?"
            continue
        result = None
        if kind <= 2:
            user, answer, result = _arithmetic(rng)
            yield user, answer
        else:
            yield (_word_task, _fact, _counting)[kind - 3](rng)


def iter_demo_chats(seed: int = 1234) -> Iterator[dict]:
    """Endless conversations ``{"messages", "task"}`` in a fixed order for ``seed``."""
    rng = random.Random(seed)
    for i in itertools.count():
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
        used = sum(_TULU_OVERHEAD[m["role"]] + len(m["content"]) for m in messages)
        for user, answer in _turns(rng):
            cost = _TULU_OVERHEAD["user"] + _TULU_OVERHEAD["assistant"] + len(user) + len(answer)
            if used + cost > CHAT_BUDGET:
                break
            messages += [{"role": "user", "content": user},
                         {"role": "assistant", "content": answer}]
            used += cost
            if len(messages) >= 6 or rng.random() < 0.45:  # 1-3 turns
                break
        yield {"messages": messages, "source": f"demo-chat-{i}"}


def write_demo_corpus(config: DemoCorpusConfig) -> tuple[int, int]:
    """Write the corpus; returns (documents, bytes). Writes a temp file, then renames,
    holding the lock of --output (one writer); an existing file is kept unless overwrite."""
    check_output_path(config.output, "--output")  # parents made, writable, before any work
    with output_lock(config.output, "--output"):
        if os.path.exists(config.output) and not config.overwrite:
            raise InputError(f"{config.output} already exists; pass --overwrite to replace it "
                             "or choose another --output")
        return _write(config)


def _write(config: DemoCorpusConfig) -> tuple[int, int]:
    max_bytes = None if config.max_mb is None else int(config.max_mb * 1e6)
    tmp = f"{config.output}{temp_marker()}"  # the lock names it: a takeover removes it
    docs = written = available = 0

    def counted(source):
        nonlocal available
        for doc in source:
            available += 1
            yield doc
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            limit = config.max_docs or (DEMO_CHATS if config.chat else None)
            source = iter_demo_chats() if config.chat else iter_demo_documents(config)
            for doc in itertools.islice(counted(source), config.skip_docs, None):
                if limit is not None and docs >= limit:
                    break
                if max_bytes is not None and written >= max_bytes:
                    break
                line = json.dumps(doc, ensure_ascii=False) + "\n"
                f.write(line)
                docs += 1
                written += len(line.encode("utf-8"))
        if not docs:  # an empty corpus only fails later, in preprocess_data, naming nothing
            raise InputError(f"--skip-docs {config.skip_docs} leaves no documents to write (the "
                             f"demo source has {available}); use a --skip-docs below "
                             f"{available}, with --max-docs for how many to write")
        os.replace(tmp, config.output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return docs, written
