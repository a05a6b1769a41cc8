"""Fixtures of the checkpoint tests: the training tests' demo dataset (one build for the
whole run, shared with tests/training) and one tiny trained run (3 steps, byte tokenizer)
that the tests copy and take apart. The helpers that train and run the tools live beside
the analysis and training tests."""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
for folder in ("analysis", "training"):
    path = os.path.join(os.path.dirname(HERE), folder)
    if path not in sys.path:
        sys.path.append(path)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """A --save directory of the trainer: iterations 2 and 3 (the tools' shared one)."""
    from checkpoint_runs import make_dataset, train

    from session_cache import build_once

    def build(root):
        return train(make_dataset(str(root)), str(root / "ckpt"))

    return build_once(tmp_path_factory, "one_writer_checkpoint", build)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from trainer_runs import build_demo_data

    from session_cache import build_once

    return build_once(tmp_path_factory, "demo_data", build_demo_data)
