"""Suite-wide: how many pytest-xdist workers, and the order test files are handed to them.

pytest.ini runs the suite on ``-n auto`` workers, one test file at a time per worker
(``--dist loadfile``: a module's fixtures are built once). Files are handed out in
collection order, so a slow file collected last would run alone at the end while the
other workers idle: the slowest files (measured on 2 cores) are collected first.
"""

import os

MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """One worker more than the cores, at most MAX_WORKERS: a worker spends part of its
    time waiting for the trainer processes it started to import torch and megatron-core,
    and the tests start their ranks themselves (two processes each)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min((cores or 1) + 1, MAX_WORKERS)

SLOW_FIRST = [
    "training/test_example_scripts.py",
    "training/test_reliability.py",
    "training/test_training_runs.py",
    "analysis/test_downstream_workflow.py",
    "training/test_run_safety.py",
    "training/test_entry_points.py",
    "training/test_sft_training.py",
    "analysis/test_eval_downstream.py",
    "training/test_trainer_variants.py",
    "training/test_gpu_checks_script.py",
    "training/test_megatron_lm_flags.py",
]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order, a file's tests stay together
