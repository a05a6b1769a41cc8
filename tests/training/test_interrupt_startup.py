"""Ctrl-C during the trainer's start-up (before its own SIGINT handler is in place): one line,
exit status 130, no traceback, and no empty --save directory left behind by the run.

The --save half is SaveLock's: a directory the lock created is removed at release when it
still holds nothing; a directory that existed before, or that got a save, stays."""

import os

from megatron_jreg.checkpoint.save_lock import SaveLock
from megatron_jreg.commands import train as train_command


def test_interrupt_in_set_up_is_one_line_and_130(monkeypatch, capsys):
    import megatron_jreg.training.trainer as trainer

    def interrupted(experiment):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "run", interrupted)
    code = train_command.main(["--model-preset", "tiny", "--data-path", "x",
                               "--tokenizer-type", "ByteTokenizer"])
    err = capsys.readouterr().err
    assert code == 130
    assert err == "interrupted during start-up; nothing was written\n", err


def test_interrupt_while_parsing_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "from_argv", interrupted)
    assert train_command.main([]) == 130
    assert capsys.readouterr().err.count("\n") == 1


def test_save_directory_made_by_the_lock_goes_when_empty(tmp_path):
    root = tmp_path / "new" / "ck"
    lock = SaveLock(str(root))
    lock.acquire()
    assert root.is_dir()
    lock.release()
    assert not root.exists()


def test_save_directory_with_a_save_or_made_before_stays(tmp_path):
    made = tmp_path / "made"
    lock = SaveLock(str(made))
    lock.acquire()
    (made / "iter_0000001").mkdir()
    lock.release()
    assert sorted(os.listdir(made)) == ["iter_0000001"]
    before = tmp_path / "before"
    before.mkdir()
    lock = SaveLock(str(before))
    lock.acquire()
    lock.release()
    assert before.is_dir() and os.listdir(before) == []


def test_save_directory_made_by_the_output_checks_goes_when_empty(tmp_path):
    from megatron_jreg.atomic_write import check_output_dir

    root = tmp_path / "ck"
    check_output_dir(str(root), "--save")  # the trainer's start-up check makes it first
    lock = SaveLock(str(root))
    lock.acquire()
    lock.release()
    assert not root.exists()
