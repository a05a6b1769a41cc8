"""A save that the OS refuses stops the trainer with one line naming the file, the cause
and the fix, exit 2 and no traceback; the last whole checkpoint stays the newest and what
the failed save wrote is left unmarked, under the temporary name the next run removes.

The causes are real: the file size limit (RLIMIT_FSIZE, as ``ulimit -f`` sets it), a full
tmpfs and a file system made read-only while the run trains. Before, each was a traceback
of megatron-core's CheckpointException (or of torch's zip writer, "unexpected pos").
"""

import os
import subprocess

import pytest
from trainer_runs import base_args, read_until, run_env, start_trainer, step_of, train

from megatron_jreg.checkpoint.dist_checkpoint import TRACKER
from write_limits import (
    FULL,
    LIMIT_FIX,
    READ_ONLY,
    make_read_only,
    one_line,
    run_limited,
    tiny_disk,
)


def _left(save):
    """What a failed save of iteration 2 left in ``save``: no tracker, no iter_0000002,
    one iter_0000002.partial-* directory (the next run on that --save removes it)."""
    names = sorted(os.listdir(save))
    assert TRACKER not in names and "iter_0000002" not in names, names
    assert [n for n in names if n.startswith("iter_")] == \
        [n for n in names if n.startswith("iter_0000002.partial-")] != [], names


def test_the_file_size_limit_during_a_save_is_one_line(demo_data, tmp_path):
    save = tmp_path / "ckpt"
    argv = ["-m", "megatron_jreg.train"] + base_args(demo_data, train_iters=2, save=save)
    proc = run_limited(argv, run_env(), limit=100_000)
    line = one_line(proc, f"error: cannot write {save}/iter_0000002.partial-",
                    ".distcp: the file size limit (ulimit -f: 100000 bytes) " + LIMIT_FIX)
    assert "iteration        2/2" in proc.stdout, line  # it trained, then the save failed
    _left(save)
    [partial] = [n for n in os.listdir(save) if ".partial-" in n]
    again = train(base_args(demo_data, train_iters=2, save=save))
    assert f"removed 1 unfinished save(s) of earlier runs: {partial}" in again.stdout
    assert open(save / TRACKER).read() == "2"


@pytest.mark.parametrize("size", ["8k", "256k"], ids=["common_pt", "shards"])
def test_a_full_disk_during_a_save_is_one_line(demo_data, tmp_path, size):
    """8k: common.pt, written first, fills it (torch's writer loses the OS error's number:
    the save's directory tells it); 256k: the shards written by megatron-core's forked
    writers do."""
    with tiny_disk(tmp_path / "disk", size) as disk:
        save = os.path.join(disk, "ckpt")
        proc = train(base_args(demo_data, train_iters=2, save=save), check=False)
        one_line(proc, f"error: cannot write {save}/iter_0000002.partial-", FULL)
        _left(save)


def test_a_file_system_made_read_only_while_training_is_one_line(demo_data, tmp_path):
    with tiny_disk(tmp_path / "disk", "16m") as disk:
        save = os.path.join(disk, "ckpt")
        proc = start_trainer(base_args(demo_data, train_iters=100000, save=save, save_interval=3,
                                       seq_length=32), stderr=subprocess.PIPE)
        try:
            read_until(proc, lambda l: step_of(l) >= 1, [], "step 1")
            make_read_only(disk)
            out, err = proc.communicate(timeout=300)
        finally:
            proc.kill()
        proc.stderr = err
        # the save at iteration 3 starts by checking --save's lock, which it refreshes
        one_line(proc, f"error: cannot write {save}/", READ_ONLY)
        assert not [n for n in os.listdir(save) if n.startswith("iter_")]
