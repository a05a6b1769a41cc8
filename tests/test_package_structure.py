"""The package map holds: no import circle between modules (function-local imports count),
and no module over 400 lines. Read from the source with ast; nothing is imported."""

import ast
import os
import re

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


# ---- the package edges docs/design.md allows ---------------------------------------------

EDGE_ROW = re.compile(r"^\| `(?P<unit>[^`]+)` \|(?P<allowed>[^|]*)\|")
COMMANDS = "commands"  # the entry points: the one layer that may import late (see below)


def unit_of(module):
    """The package map's unit of a module: ``megatron_jreg.data.preprocess.writer`` is
    ``data``, a top-level module (``megatron_jreg.errors``) is ``errors``, the package's
    ``__init__`` is ``megatron_jreg``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "megatron_jreg"


def allowed_edges(text):
    """{unit: units it may import} from the "Package edges" table of docs/design.md."""
    table = text.split("## Package edges", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = EDGE_ROW.match(line)
        if m and m["unit"] != "unit":
            rows[m["unit"]] = set(re.findall(r"`([^`]+)`", m["allowed"]))
    return rows


def imports_in_functions(path):
    """(line, module) of each package import inside a function or class body."""
    found = []
    tree = ast.parse(open(path).read(), path)
    for top in tree.body:
        if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(top):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.split(".")[0] == "megatron_jreg":
                found.append((node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found += [(node.lineno, a.name) for a in node.names
                          if a.name.split(".")[0] == "megatron_jreg"]
    return found


def edge_violations(known, rows):
    """'a -> b (module -> module)' for each import between units the table does not allow."""
    bad = []
    for module, path in sorted(known.items()):
        if path is None:
            continue
        source = unit_of(module)
        for target in sorted(imports_of(path, known)):
            dest = unit_of(target)
            if dest != source and dest not in rows.get(source,
                                                       set()) and "*" not in rows.get(source,
                                                                                      set()):
                bad.append(f"{source} -> {dest} ({module} -> {target})")
    return bad


def test_every_unit_is_on_the_map():
    rows = allowed_edges(open(os.path.join(REPO, "docs", "design.md")).read())
    units = {unit_of(m) for m in modules()}
    assert units - set(rows) == set(), "units missing from docs/design.md's Package edges table"
    assert set(rows) - units == set(), "Package edges rows for units that do not exist"


def test_imports_follow_the_package_edges():
    rows = allowed_edges(open(os.path.join(REPO, "docs", "design.md")).read())
    assert edge_violations(modules(), rows) == []


def test_the_edge_checker_finds_a_planted_back_edge(tmp_path):
    low, high = tmp_path / "low.py", tmp_path / "high.py"
    low.write_text("def f():\n    from megatron_jreg.high import g\n")  # late, still an edge
    high.write_text("from megatron_jreg.low import f\n")
    known = {"megatron_jreg.low": str(low), "megatron_jreg.high": str(high)}
    rows = {"low": set(), "high": {"low"}}
    assert edge_violations(known, rows) == [
        "low -> high (megatron_jreg.low -> megatron_jreg.high)"]
    text = "## Package edges\n\n| unit | may import |\n|---|---|\n| `low` | |\n| `high` | `low` |\n"
    assert allowed_edges(text) == rows


def test_no_function_local_import_of_the_package_below_commands():
    """A library module imports the package at its top, where the edges are seen; only a
    command may import its work after parsing, so --help and a bad flag answer at once."""
    late = [f"{module}:{line} imports {target}"
            for module, path in sorted(modules().items())
            if unit_of(module) != COMMANDS
            for line, target in imports_in_functions(path)]
    assert late == []


def test_no_argparse_below_commands():
    users = []
    for module, path in sorted(modules().items()):
        if unit_of(module) == COMMANDS:
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) else [])
            if "argparse" in names:
                users.append(f"{module}:{node.lineno}")
    assert users == []


def test_the_late_import_checker_sees_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\nclass A:\n    def f(self):\n        import megatron_jreg.jreg\n"
                    "        from megatron_jreg import ops\n        import json\n")
    assert imports_in_functions(str(path)) == [(5, "megatron_jreg.jreg"), (6, "megatron_jreg")]
