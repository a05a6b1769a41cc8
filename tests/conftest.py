"""Suite-wide: the order test files are handed to the pytest-xdist workers.

pytest.ini runs the suite on one worker per core, one test file at a time per worker
(``--dist loadfile``: a module's fixtures are built once). Files are handed out in
collection order (``--no-loadscope-reorder``; xdist would otherwise start with the files
that hold the most tests), so a slow file collected last would run alone at the end while
the other workers idle: the slowest files (measured on 2 cores) are collected first.
"""

import os

# Every run a test starts, in this process or a subprocess (which inherits it), is a CPU
# run on gloo, also on a machine with GPUs: two ranks on one GPU would not be the layouts
# these tests mean, and CI has no GPU. The GPU-marked tests (python -m pytest -m gpu) put
# their tensors on the GPU themselves.
os.environ["MEGATRON_JREG_DEVICE"] = "cpu"

SLOW_FIRST = [
    "training/test_example_scripts.py",
    "training/test_continued_pretraining_example.py",
    "analysis/test_downstream_workflow.py",
    "analysis/test_eval_downstream.py",
    "training/test_reliability.py",
    "training/test_families_example.py",
    "analysis/test_convert_from_hf.py",
    "analysis/test_hf_model_references.py",
    "training/test_training_runs.py",
    "training/test_run_safety.py",
    "training/test_entry_points.py",
    "training/test_sft_training.py",
    "analysis/test_downstream_attacks.py",
    "analysis/test_one_writer_tools.py",
    "training/test_pinned_run.py",
    "training/test_trainer_variants.py",
    "training/test_gpu_checks_script.py",
    "training/test_megatron_lm_flags.py",
    "training/test_output_paths_training.py",
    "analysis/test_eval_jump_checkpoint.py",
    "analysis/test_eval_jump_torchrun.py",
]


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return SLOW_FIRST.index(path) if path in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order, a file's tests stay together


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory) -> str:
    """SmolLM2-135M-Instruct as a plain fp32 Hugging Face directory, built once per run."""
    from real_model import build_smollm2_hf
    from session_cache import build_once

    return build_once(tmp_path_factory, "smollm2_hf", build_smollm2_hf)
