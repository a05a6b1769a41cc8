"""A directory no process here can create files in, for the output-path tests."""

import os
import tempfile

import pytest


def unwritable_dir(tmp_path):
    """chmod 555 for a normal user; root ignores modes, so for root sysfs, where nobody
    may create files."""
    if os.geteuid() != 0:
        path = tmp_path / "read-only"
        path.mkdir()
        path.chmod(0o555)
        return str(path)
    try:
        tempfile.mkstemp(dir="/sys/kernel")
    except OSError:
        return "/sys/kernel"
    pytest.skip("no unwritable directory on this machine")
