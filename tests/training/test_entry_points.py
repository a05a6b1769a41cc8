"""First contact: every entry point answers --help, a bare trainer call fails in one line, and
every ``pip install`` the docs show works as written from the repo root (of a copy).

The install test really installs (it is in the default run, so CI executes it); deselect it
locally with ``python -m pytest -m "not install"``.
"""

import ast
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from trainer_runs import REPO, run_env

DOCS = ["README.md"] + sorted(os.path.relpath(p, REPO)
                              for p in glob.glob(os.path.join(REPO, "docs", "*.md")))
INSTALL_BUDGET_S = 15 * 60  # all the install commands together


# ---------------------------------------------------------------------------- entry points

def _setup_ast():
    with open(os.path.join(REPO, "setup.py")) as f:
        return ast.parse(f.read())


def _console_scripts():
    """Names of the ``console_scripts`` declared in setup.py (string literals under that key)."""
    names = []
    for node in ast.walk(_setup_ast()):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "console_scripts":
                    for item in ast.literal_eval(value):
                        names.append(item.split("=", 1)[0].strip())
    return names


def _entry_points():
    """(id, argv) of every way a user starts something: the trainer, each tool, each script."""
    points = [("megatron_jreg.train", [sys.executable, "-m", "megatron_jreg.train"])]
    # every tool, found by glob so a new one is covered without editing this file
    # (names starting with "_" would be helper modules, not programs)
    for path in sorted(glob.glob(os.path.join(REPO, "tools", "*.py"))):
        name = os.path.basename(path)
        if not name.startswith("_"):
            points.append((f"tools/{name}", [sys.executable, f"tools/{name}"]))
    for name in _console_scripts():
        points.append((name, [name]))
    return points


ENTRY_POINTS = _entry_points()


def test_entry_points_were_found():
    ids = [i for i, _ in ENTRY_POINTS]
    assert "megatron_jreg.train" in ids and len(ids) >= 2, ids  # the glob found the tools


@pytest.mark.parametrize("argv", [a for _, a in ENTRY_POINTS], ids=[i for i, _ in ENTRY_POINTS])
def test_help_exits_0_with_usage(argv):
    proc = subprocess.run(argv + ["--help"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.lstrip().startswith("usage:"), proc.stdout[:500]
    assert len(proc.stdout.strip().splitlines()) > 1, proc.stdout  # more than a bare usage line


def test_trainer_without_arguments_fails_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train"], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "error: --data-path is missing" in lines[0], lines[0]
    assert "tools/preprocess_data.py" in lines[0]  # it names the fix
    assert "see --help" not in lines[0]
    assert proc.stdout == ""


# ---------------------------------------------------------------------------- install commands

def _code_of(path):
    """(fenced logical lines, inline code spans, prose with all code removed) of a markdown file."""
    with open(os.path.join(REPO, path)) as f:
        lines = f.read().splitlines()
    fenced, prose, fence = [], [], None
    pending = ""
    for line in lines:
        marker = re.match(r"\s*(```+|~~~+)", line)
        if fence is None and marker:
            fence = marker.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
                continue
            if line.rstrip().endswith("\\"):  # a continued shell line
                pending += line.rstrip()[:-1] + " "
                continue
            fenced.append(pending + line)
            pending = ""
            continue
        prose.append(line)
    text = "\n".join(prose)
    spans = [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]  # a span may wrap lines
    return fenced, spans, re.sub(r"`[^`]+`", "", text)


def _pip_commands(code):
    """The ``pip install`` commands of a code line: each one of an ``a && b; c`` chain."""
    return [part.strip() for part in re.split(r"&&|\|\||;", code)
            if part.strip().startswith("pip install")]


def doc_install_commands():
    """(file, command) of every pip install in README.md and docs/*.md, in order."""
    found = []
    for path in DOCS:
        fenced, spans, _ = _code_of(path)
        for code in fenced + spans:
            found += [(path, cmd) for cmd in _pip_commands(code)]
    return found


def _setup_extras():
    """The extras of setup.py, read from its ``EXTRAS`` dict without running setup()."""
    extras = set()
    for node in ast.walk(_setup_ast()):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "EXTRAS" and isinstance(node.value,
                                                                                         ast.Dict):
                    extras |= {k.value for k in node.value.keys}
                if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                        and target.value.id == "EXTRAS" and isinstance(target.slice, ast.Constant)):
                    extras.add(target.slice.value)
    return extras


def test_install_commands_are_found_and_well_formed():
    """Runs without network: the forms that fail on a fresh machine never come back."""
    commands = doc_install_commands()
    assert any(f == "README.md" for f, _ in commands), commands  # never passes on nothing
    for path in DOCS:  # a pip install outside code would escape the install test
        assert "pip install" not in _code_of(path)[2], f"{path}: a `pip install` outside code"
    extras = _setup_extras()
    assert {"data", "hf", "plot", "stats", "test"} <= extras, extras
    for path, cmd in commands:
        where = f"{path}: {cmd}"
        assert "megatron-jreg" not in cmd and "megatron_jreg" not in cmd, f"{where}: not on PyPI"
        if re.search(r"\s-e\s|\s\.(\s|$)|\"\.", cmd):  # this package, from the repo root
            match = re.fullmatch(r'pip install --no-build-isolation -e "\.(?:\[([a-z,-]+)\])?"',
                                 cmd)
            assert match, f'{where}: use pip install --no-build-isolation -e ".[extra]"'
            unknown = set((match.group(1) or "").split(",")) - extras - {""}
            assert not unknown, f"{where}: no such extra {sorted(unknown)} in setup.py"
        if re.search(r"lm[-_]eval", cmd):
            assert cmd.split("#")[0].split()[2:] == ['"lm_eval[hf]==0.4.13"'], \
                f'{where}: lm_eval --model hf needs pip install "lm_eval[hf]==0.4.13"'


def _copy_installed_kernel(checkout):
    """This checkout's kernel-cache entry of the kernel installed now, into the copy."""
    import torch  # noqa: F401 (the extension links against torch's libraries: load them first)

    import megatron_jreg._C as kernel

    cache = os.path.join(REPO, "build", "kernel-cache")
    installed = open(kernel.__file__, "rb").read()
    for entry in sorted(os.listdir(cache)) if os.path.isdir(cache) else []:
        built = os.path.join(cache, entry, os.path.basename(kernel.__file__))
        if os.path.isfile(built) and open(built, "rb").read() == installed:
            shutil.copytree(os.path.join(cache, entry), checkout / "build" / "kernel-cache" / entry)
            return


@pytest.mark.install
def test_every_documented_install_command_runs(tmp_path):
    """Each ``pip install`` of the docs, run as written from the root of a copy of this
    checkout, with the pip of a virtual environment over this Python's packages first on
    PATH. The copy and the environment keep the installs away from the checkout and the
    environment the other tests are running in (an editable install rebuilds the extension
    in place). Only the pip commands of a line run: README's set-up lines go on to run the
    demo and the whole test suite, which would start this test again. The copy takes this
    checkout's build/kernel-cache (a user's checkout that was installed once has it): the
    kernel compiled by the install that set up this suite is copied, not compiled again."""
    commands, seen = [], set()
    for path, cmd in doc_install_commands():
        if cmd not in seen:  # the same command twice installs nothing new
            seen.add(cmd)
            commands.append((path, cmd))
    assert any(f == "README.md" for f, _ in commands), commands
    checkout = tmp_path / "checkout"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if os.path.isfile(os.path.join(REPO, name)):  # a deleted, not yet committed file is listed
            os.makedirs(checkout / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), checkout / name)
    _copy_installed_kernel(checkout)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    bindir = str(venv / "bin")
    assert os.path.exists(os.path.join(bindir, "pip")), f"no pip in {bindir}"
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), PIP_NO_INPUT="1",
               VIRTUAL_ENV=str(venv))
    env.pop("PYTHONPATH", None)  # as a user types it
    start = time.monotonic()
    for path, cmd in commands:
        left = INSTALL_BUDGET_S - (time.monotonic() - start)
        assert left > 0, f"the install commands took over {INSTALL_BUDGET_S} s; next: {cmd}"
        t0 = time.monotonic()
        proc = subprocess.run(cmd, shell=True, executable="/bin/bash", cwd=checkout, env=env,
                              capture_output=True, text=True, timeout=left)
        print(f"{time.monotonic() - t0:6.1f} s  {path}: {cmd}")
        assert proc.returncode == 0, f"{path}: `{cmd}` failed ({proc.returncode}):\n" \
                                     f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    # the environment's package is the copy's, its kernel built by the install
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import torch, megatron_jreg, megatron_jreg._C as c; "
                            "print(megatron_jreg.__file__, c.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    package, kernel = probe.stdout.split()
    assert package.startswith(str(checkout)) and kernel.startswith(str(checkout)), probe.stdout
    # the kernel in use is one kept in build/kernel-cache (built by the first editable
    # install, or the entry copied in); a changed source is built again under a new key
    cache = checkout / "build" / "kernel-cache"
    entries = os.listdir(cache)
    built = open(kernel, "rb").read()
    assert [e for e in entries
            if open(cache / e / os.path.basename(kernel), "rb").read() == built], \
        entries
    with open(checkout / "csrc" / "displacement_cpu.cpp", "a") as f:
        f.write("// changed\n")
    proc = subprocess.run(commands[-1][1], shell=True, executable="/bin/bash", cwd=checkout,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(os.listdir(cache)) == len(entries) + 1, os.listdir(cache)
