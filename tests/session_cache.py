"""Session fixtures built once per test run, however many pytest-xdist workers run it.

Each xdist worker is its own session, so a plain ``scope="session"`` fixture is built once
per worker: the demo datasets and tiny training runs would be built twice on two workers.
``build_once`` builds under a file lock in the directory the workers share (the parent of
each worker's base temp) and records the result; the other workers wait for the lock and
read the record. Without xdist it is an ordinary session fixture body.
"""

import json
import os
import shutil

from filelock import FileLock


def build_once(tmp_path_factory, name, build):
    """``build(directory)`` once for the whole run; returns its JSON-able result."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / "built_once"
    shared.mkdir(exist_ok=True)
    record = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if record.exists():
            return json.loads(record.read_text())["result"]
        directory = shared / name
        shutil.rmtree(directory, ignore_errors=True)  # a worker whose build failed left it
        directory.mkdir()
        result = build(directory)
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps({"result": result}))
        os.replace(tmp, record)
        return result
