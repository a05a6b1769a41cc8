"""eval_downstream loads local tasks without indexing lm-eval's own thousands of task YAMLs
(seconds on every run), and falls back to the full index for a task that is not local."""

import pytest

from downstream_tasks import CHOICE, LAMBADA, write_tasks
from megatron_jreg.downstream import harness
from megatron_jreg.errors import InputError

pytest.importorskip("lm_eval")


@pytest.fixture
def managers(monkeypatch):
    """The ``include_defaults`` of every TaskManager load_tasks builds, in order."""
    from lm_eval.tasks import TaskManager

    built = []

    def spy(*args, include_defaults=True, **kwargs):
        built.append(include_defaults)
        return TaskManager(*args, include_defaults=include_defaults, **kwargs)

    monkeypatch.setattr(harness, "_import_lm_eval", lambda: spy)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return built


def test_local_tasks_are_loaded_from_their_folder_only(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    manager, digests = harness.load_tasks([tasks], [LAMBADA, CHOICE])
    assert managers == [False] and set(manager.all_tasks) == {LAMBADA, CHOICE}
    # the digests are those the fully indexed manager gives (the cache keys do not change)
    assert digests == harness.check_tasks(harness.task_manager([tasks]), [LAMBADA, CHOICE])


def test_a_task_that_is_not_local_is_looked_up_in_lm_evals_index(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    with pytest.raises(InputError, match="unknown task no_such_task"):
        harness.load_tasks([tasks], [LAMBADA, "no_such_task"])
    assert managers == [False, True]
    assert harness.load_tasks(None, [])[0] is not None and managers[-1] is True
