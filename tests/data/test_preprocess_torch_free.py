"""Preprocessing and the tokenizers import neither torch nor megatron-core: every module of
``data/preprocess/`` and ``data/tokenizers/``, imported in a fresh interpreter, leaves both
out of ``sys.modules`` (a module added later is checked too). The tools' own runs are
checked in test_indexed_writer.py; this holds for modules no run of theirs imports."""

import os
import pkgutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("megatron_jreg.data.preprocess", "megatron_jreg.data.tokenizers")

_CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "megatron.")))
print(" ".join(heavy[:5]))
sys.exit(1 if heavy else 0)
"""


def package_modules(package):
    path = os.path.join(REPO, *package.split("."))
    assert os.path.isfile(os.path.join(path, "__init__.py")), path
    return [package] + [f"{package}.{info.name}" for info in pkgutil.iter_modules([path])]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_imports_torch_or_megatron_core(package):
    modules = package_modules(package)
    assert len(modules) > 3  # the package's modules were found
    proc = subprocess.run([sys.executable, "-c", _CHECK, *modules], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, f"importing {package} imported {proc.stdout.strip()}{proc.stderr}"
