"""The package map holds: no import circle between modules (function-local imports count),
and no module over 400 lines. Read from the source with ast; nothing is imported."""

import ast
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "megatron_jreg")
MAX_LINES = 400


def modules():
    """{dotted module name: path} of every .py file in the package."""
    found = {}
    for base, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, REPO)[: -len(".py")].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                found[".".join(rel)] = path
    return found


def imports_of(path, known):
    """Package modules that ``path`` imports, anywhere in the file."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from a.b import c` is module a.b.c when that is a module, else a.b
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known
                     else node.module for alias in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def cycles(graph):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def test_the_checker_finds_a_planted_circle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("def f():\n    from pkg.b import g\n")
    b.write_text("from pkg import a\n")
    known = {"pkg": None, "pkg.a": str(a), "pkg.b": str(b)}
    graph = {m: imports_of(p, known) - {m} for m, p in known.items() if p}
    graph["pkg"] = set()
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_circle():
    known = modules()
    graph = {m: imports_of(p, known) - {m} for m, p in known.items()}
    assert cycles(graph) == []


@pytest.mark.parametrize("module", sorted(modules()))
def test_module_under_400_lines(module):
    path = modules()[module]
    lines = sum(1 for _ in open(path))
    assert lines <= MAX_LINES, f"{os.path.relpath(path, REPO)} has {lines} lines"
