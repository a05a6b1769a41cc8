"""Every place in the package and tools/ that branches on the device is one docs/design.md
lists ("Where the code branches on the device"), with why it stays and the CPU test that
runs its GPU arm. A new branch fails here until it is removed or listed with such a test.

Read from the source with ast. A branch is a test (if, while, assert, a comparison), a
conditional expression anywhere in it, or a dict key naming a device or backend ("cuda",
"cpu", "nccl", "gloo"; also in a ``match``, a ``startswith``, ``dict(cuda=...)``), a query
of the device (``use_cpu()``, ``torch.cuda.is_available()``, ``is_initialized()``,
``device_count()``, ``dist.get_backend()``, ``torch.backends.cuda.*``, ``.is_cuda``,
``.is_cpu``) anywhere. Behaviour that differs by device without a branch (a generator
created on the parameters' device) is not seen here; ``tests/model/test_init_device.py``
pins the one found. The device mapping itself (``platform/cpu.py``, ``platform/device.py``)
is where the device is decided and is not listed.

The same for the branches on what is installed (a call to one of megatron-core's probes of
Transformer Engine, its fused RoPE or apex's kernel, none of which a CPU machine has): each
is listed in design.md's "Where the code branches on what is installed" with the CPU test
that sets the probe and takes the arm the package's presence gives."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("megatron_jreg", "tools")
MAPPING = {"megatron_jreg/platform/cpu.py", "megatron_jreg/platform/device.py"}
WORDS = {"cuda", "cpu", "nccl", "gloo"}
CUDA_QUERIES = {"is_available", "is_initialized", "device_count"}
ROW = re.compile(r"^\| `(?P<path>[^`]+)` `(?P<function>[^`]+)` \| (?P<why>[^|]+) \| "
                 r"`(?P<test>[^`]+)::(?P<test_name>[^`]+)` \|$")


def _chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def _queries_device(node):
    if isinstance(node, ast.Call):
        name = _chain(node.func)
        if name and (name[-1] in ("use_cpu", "get_backend")
                     or (name[-1] in CUDA_QUERIES and "cuda" in name)
                     or name[:3] == ["torch", "backends", "cuda"]):  # SDPA kernel checks
            return True
        if name and name[-1] in ("startswith", "endswith") and any(map(_names_device, node.args)):
            return True
        if name == ["dict"] and any(k.arg in WORDS for k in node.keywords):
            return True
    return isinstance(node, ast.Attribute) and node.attr in ("is_cuda", "is_cpu")


def _names_device(node):
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and (
        node.value in WORDS or node.value.startswith("cuda:"))


def _mentions_device(expr):
    return any(_queries_device(n) or _names_device(n) for n in ast.walk(expr))


def branches(source):
    """{enclosing function's dotted name: [line, ...]} of the device branches in ``source``."""
    found = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scope + [child.name]
            tests = isinstance(child, (ast.If, ast.While, ast.Assert))
            if isinstance(child, ast.Match) and _mentions_device(child):
                found.setdefault(".".join(scope) or "<module>", []).append(child.lineno)
            if ((tests and _mentions_device(child.test))
                    or (isinstance(child, ast.IfExp) and _mentions_device(child))
                    or (isinstance(child, ast.Compare) and _mentions_device(child))
                    or (isinstance(child, ast.Dict) and any(k is not None and _names_device(k)
                                                            for k in child.keys))
                    or _queries_device(child)):
                found.setdefault(".".join(scope) or "<module>", []).append(child.lineno)
            visit(child, inner)

    visit(ast.parse(source), [])
    return found


def found_branches():
    found = {}
    for top in SCANNED:
        for base, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(files):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, REPO).replace(os.sep, "/")
                if not name.endswith(".py") or rel in MAPPING:
                    continue
                with open(path) as f:
                    for function, lines in branches(f.read()).items():
                        found[(rel, function)] = lines
    return found


def listed_branches(heading="## Where the code branches on the device"):
    with open(os.path.join(REPO, "docs", "design.md")) as f:
        text = f.read()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return {(m["path"], m["function"]): m for m in map(ROW.match, section.splitlines()) if m}


def test_every_device_branch_is_listed_with_a_gpu_arm_test():
    found, listed = found_branches(), listed_branches()
    unlisted = {f"{path} {function} (lines {lines})" for (path, function), lines in found.items()
                if (path, function) not in listed}
    assert not unlisted, (
        "new branches on the device: remove them (ask megatron_jreg/platform/device.py) or "
        f"list them in docs/design.md with a CPU test of their GPU arm: {sorted(unlisted)}")
    stale = set(listed) - set(found)
    assert not stale, f"docs/design.md lists device branches that are gone: {sorted(stale)}"
    for row in listed.values():
        with open(os.path.join(REPO, row["test"])) as f:
            assert f"def {row['test_name']}(" in f.read(), row["test"] + "::" + row["test_name"]


# ---- branches on what is installed --------------------------------------------------------
# megatron-core's probes of its optional packages (Transformer Engine, TE's fused RoPE, apex's
# fused weight-gradient kernel). A CPU machine has none of them: a function that asks one is
# listed in docs/design.md with the CPU test that sets the probe and takes the other arm.
PROBES = {"transformer_engine_available", "fused_rope_available", "fused_wgrad_available"}


def probe_calls(source):
    """{enclosing function's dotted name: [line, ...]} of the calls to a probe in ``source``."""
    found = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scope + [child.name]
            if isinstance(child, ast.Call) and set(_chain(child.func)[-1:]) & PROBES:
                found.setdefault(".".join(scope) or "<module>", []).append(child.lineno)
            visit(child, inner)

    visit(ast.parse(source), [])
    return found


def test_every_branch_on_what_is_installed_is_listed_with_a_test_of_its_other_arm():
    found = {}
    for top in SCANNED:
        for base, _, files in os.walk(os.path.join(REPO, top)):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(base, name)
                with open(path) as f:
                    for function, lines in probe_calls(f.read()).items():
                        found[(os.path.relpath(path, REPO).replace(os.sep, "/"), function)] = lines
    listed = listed_branches("## Where the code branches on what is installed")
    unlisted = sorted(f"{path} {function} (lines {lines})"
                      for (path, function), lines in found.items()
                      if (path, function) not in listed)
    assert not unlisted, ("new branches on what is installed: list them in docs/design.md with a "
                          f"CPU test that sets the probe: {unlisted}")
    stale = set(listed) - set(found)
    assert not stale, f"docs/design.md lists branches on what is installed, gone: {sorted(stale)}"
    for row in listed.values():
        with open(os.path.join(REPO, row["test"])) as f:
            assert f"def {row['test_name']}(" in f.read(), row["test"] + "::" + row["test_name"]


def test_the_scanner_sees_each_kind_of_branch():
    source = '''
def a(x):
    return "nccl" if x else "gloo"
def b(t):
    if t.device.type == "cuda":
        return 1
def c():
    return use_cpu()
def d():
    return {"cpu": 1}
def e(t):
    return t.is_cuda and torch.cuda.is_available()
def f():
    return dist.get_backend()
def g(t):
    return t.to("cpu")  # placing a tensor is no branch
def h(t):
    return t.is_cpu
def i(d):
    return str(d).startswith("cuda")
def j():
    return torch.backends.cuda.flash_sdp_enabled()
def k():
    return dict(cuda=1, cpu=2)
def m(d):
    match d.type:
        case "cuda":
            return 1
'''
    assert sorted(branches(source)) == ["a", "b", "c", "d", "e", "f", "h", "i", "j", "k", "m"]


def test_the_installed_scanner_sees_a_call_to_each_probe():
    source = '''
def a():
    return transformer_engine_available()
def b(layers):
    return layers.fused_wgrad_available() or fused_rope_available()
def c():
    return fused_rope_available  # named, not asked
'''
    assert probe_calls(source) == {"a": [3], "b": [5, 5]}
