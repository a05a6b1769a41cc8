"""eval_downstream loads local tasks without indexing lm-eval's own thousands of task YAMLs
(seconds on every run), and falls back to the full index for a task that is not local.

A local task lm-eval would skip or score 0 without a word is refused in one line before
any model: a YAML with a syntax error (named with its line) or without a ``task:`` line,
a multiple-choice target that is no index of the choices nor one of them, and one task
name given by two YAMLs (both named)."""

import re

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


# ---- attack 40 #70, #71, #73, #75: a local task lm-eval skips or scores 0 in silence.
# The code before said "unknown task ... needs its YAML folder in --include-path" with the
# folder given (#70, #71), scored a task whose targets name no choice as acc 0.00 (#73),
# and took one of two YAMLs of one task name with a warning among progress lines (#75).


def _edit(folder, old, new, name=CHOICE + ".yaml"):
    path = folder / name
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return str(path)


def test_a_yaml_with_a_syntax_error_is_named_with_its_line(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    # an lm-eval !function tag in another YAML is read, not refused
    _edit(tmp_path, 'doc_to_text: "', 'process_docs: !function utils.nothing\ndoc_to_text: "',
          LAMBADA + ".yaml")
    path = _edit(tmp_path, "doc_to_choice: choices", "doc_to_choice: [choices")
    with pytest.raises(InputError) as err:
        harness.load_tasks([tasks], [CHOICE])
    assert str(err.value) == (
        f"--tasks: unknown task {CHOICE}; lm-eval skipped {path} of --include-path: it is not "
        "valid YAML (line 9, column 16: while parsing a flow sequence, did not find expected "
        "',' or ']' at line 10, column 14); fix that file")


def test_a_yaml_without_a_task_line_is_named(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    (tmp_path / "_base.yaml").write_text("output_type: multiple_choice\n")  # an include base
    _edit(tmp_path, "test_split: test\n", "test_split: test\ninclude: _base.yaml\n",
          LAMBADA + ".yaml")
    path = _edit(tmp_path, f"task: {CHOICE}\n", "")
    with pytest.raises(InputError) as err:
        harness.load_tasks([tasks], [CHOICE])
    assert str(err.value) == (f"--tasks: unknown task {CHOICE}; lm-eval skipped {path} of "
                              f"--include-path: it has no `task:` line; add `task: {CHOICE}` to it")


@pytest.mark.parametrize("target, shown", [
    ("nosuchfield", "doc_to_target: 'nosuchfield' (no such field; the data's fields: question, "
                    "choices, label) gives 'nosuchfield' on document 0 {'question': "),
    # a split without answers (label -1): lm-eval's own load check indexes choices[-1]
    ("label", "doc_to_target: 'label' gives -1 on document 2 {'question': "),
])
def test_targets_that_are_no_choice_are_refused(tmp_path, managers, target, shown):
    tasks = write_tasks(str(tmp_path))
    _edit(tmp_path, "doc_to_target: label", f"doc_to_target: {target}")
    lines = (tmp_path / "choice.jsonl").read_text().splitlines(keepends=True)
    lines[2] = re.sub(r'"label": \d+', '"label": -1', lines[2])
    (tmp_path / "choice.jsonl").write_text("".join(lines))
    with pytest.raises(InputError) as err:
        harness.load_tasks([tasks], [CHOICE])
    text = str(err.value)
    assert text.startswith(f"task {CHOICE}: {shown}"), text
    assert "where doc_to_choice: 'choices' gives 4 choices; the target must be an index" in text
    assert "\n" not in text


def test_a_target_that_is_one_of_the_choices_is_accepted(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    _edit(tmp_path, "doc_to_target: label", "doc_to_target: '{{choices[label]}}'")
    assert set(harness.load_tasks([tasks], [CHOICE])[1]) == {CHOICE}


def test_one_task_name_in_two_yamls_is_refused(tmp_path, managers):
    tasks = write_tasks(str(tmp_path))
    first = str(tmp_path / f"{CHOICE}.yaml")
    second = tmp_path / "other.yaml"
    second.write_text(open(first).read() + 'description: "other"\n')
    with pytest.raises(InputError) as err:
        harness.load_tasks([tasks], [CHOICE, LAMBADA])
    assert str(err.value) == (
        f"task {CHOICE} is defined twice in --include-path: {second} and {first} (lm-eval "
        "would take the first and skip the other); rename one task or remove one file")
