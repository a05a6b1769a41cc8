"""`ruff check .` (docs/design.md, "Running the tests") passes on the tree as written."""

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.fail("ruff is not installed: pip install -e '.[test]' installs the pinned one")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_the_config_catches_what_it_is_for(tmp_path):
    """A file with an unused import, unsorted imports, a long line and a closure over a
    loop variable gives exactly those findings under the repository's ruff.toml."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\n\nx = '" + "y" * 120 + "'\n\n"
                   "fns = []\nfor i in range(3):\n    fns.append(lambda: i)\n")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config",
                           os.path.join(REPO, "ruff.toml"), "--output-format", "concise",
                           str(bad)], capture_output=True, text=True, timeout=120)
    codes = sorted({line.split(" ")[1] for line in proc.stdout.splitlines()
                    if line.startswith(str(bad))})
    assert codes == ["B023", "E501", "F401", "I001"], proc.stdout
