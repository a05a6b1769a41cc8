"""What a training step waits for and communicates: counted on the CPU.

A wait for the device is a read of a tensor's value on the host (``item``, ``tolist``,
``float``, ``int``, ``bool``); a collective is a call of ``torch.distributed``. The trainer's
own part of a step does neither: the LM loss and the JREG sums stay on the device until the
log step, which reads them for the whole window with one all-reduce per group (PP and DP for
the loss; TP, PP and DP for Psi) and two reads. What remains in a step is megatron-core's:
the gradient norm (read for clipping and for the skip of a non-finite step; without apex or
Transformer Engine also its l2-norm fallback), the cross-entropy's TP reductions, and the
gradient all-reduce.

Reads of host tensors are not waits on a GPU and are left out: torch's Adam step counters
(host scalars unless capturable) and the micro-batches assembled before their copy to the
device (data/datasets/batches.py)."""

import os
import traceback

import pytest
import torch
import torch.distributed as dist
from set_up_trainer import set_up
from torch.overrides import TorchFunctionMode
from trainer_runs import base_args

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__bool__, torch.Tensor.__index__}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "broadcast", "all_gather_object", "broadcast_object_list", "barrier")
PACKAGE = os.path.join("megatron_jreg", "")
HOST_TENSORS = (os.path.join("torch", "optim", ""),
                os.path.join("megatron_jreg", "data", "datasets", "batches.py"))


def _site():
    """(the innermost frame's file outside torch's dispatch and this file, whether it is this
    package's)."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != __file__
              and os.path.join("torch", "overrides.py") not in f.filename
              and os.path.join("torch", "distributed", "") not in f.filename
              and os.path.join("torch", "_tensor.py") not in f.filename]
    where = f"{frames[-1].filename}:{frames[-1].lineno}"
    return where, PACKAGE in frames[-1].filename


class Counts(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads, self.collectives = [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            where, ours = _site()
            if not any(part in where for part in HOST_TENSORS):
                self.reads.append((where, ours))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """The trainer's steps and log calls, each with the reads and collectives it made."""
    current = {"counts": None}
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def wrapper(*args, _real=real, **kwargs):
            if current["counts"] is not None:
                current["counts"].collectives.append(_site())
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, wrapper)
    return current


def test_a_step_waits_only_for_the_gradient_norm_and_logging_reads_the_window_once(
        demo_data, counted):
    steps = []
    with set_up(base_args(demo_data, train_iters=6, log_interval=3)) as run:
        trainer = run.trainer

        def measured(method, kind):
            def call(*args, **kwargs):
                counts = counted["counts"] = Counts()
                try:
                    with counts:
                        return method(*args, **kwargs)
                finally:
                    counted["counts"] = None
                    steps.append((kind, counts))
            return call

        trainer.train_step = measured(trainer.train_step, "step")
        trainer._log_window = measured(trainer._log_window, "log")
        assert trainer.train() == 0
    kinds = [kind for kind, _ in steps]
    assert kinds == ["step", "step", "step", "log"] * 2
    for kind, counts in steps:
        ours_reads = [where for where, ours in counts.reads if ours]
        ours_collectives = [where for where, ours in counts.collectives if ours]
        if kind == "step":
            assert ours_reads == [] and ours_collectives == [], (ours_reads, ours_collectives)
            theirs = sorted(os.path.basename(where).split(":")[0] for where, _ in counts.reads)
            # megatron-core's: the norm's read, and its l2-norm fallback without apex/TE
            assert theirs == ["clip_grads.py", "utils.py"], counts.reads
            assert len(counts.collectives) == 8, counts.collectives  # 6 CE (TP), grads, norm
        else:
            assert len(ours_reads) == 2, ours_reads  # the window's losses and Psi
            assert len(ours_collectives) == 5, ours_collectives  # loss: PP, DP; Psi: TP, PP, DP


def test_tokens_per_second_counts_training_steps_only(demo_data, tmp_path):
    """An evaluation and a save that take a second each (made so here) are not in tokens/s:
    it equals the tokens over the steps' own time; their seconds are logged apart, in the
    row of the window they fell in and in the validation row."""
    import json
    import time

    metrics = tmp_path / "m.jsonl"
    step_seconds = []
    with set_up(base_args(demo_data, train_iters=4, log_interval=1, eval_interval=2, eval_iters=1,
                          save=tmp_path / "ckpt", save_interval=2, metrics_file=metrics)) as run:
        trainer = run.trainer
        step, evaluate, save = trainer.train_step, trainer.evaluate, trainer.save

        def timed_step():
            t0 = time.perf_counter()
            try:
                return step()
            finally:
                step_seconds.append(time.perf_counter() - t0)

        def slow(method):
            def call():
                time.sleep(1.0)
                return method()
            return call

        trainer.train_step, trainer.evaluate, trainer.save = timed_step, slow(evaluate), slow(save)
        assert trainer.train() == 0
    rows = [json.loads(line) for line in open(metrics)]
    train = [r for r in rows if "lm_loss" in r]
    valid = [r for r in rows if "validation_lm_loss" in r]
    tokens = 8 * 64  # global batch x sequence length
    for row, seconds in zip(train, step_seconds):
        # the row's window: its step, and the log call; never a second of evaluation or saving
        assert tokens / seconds / 1.5 < row["tokens_per_s"] <= tokens / seconds * 1.01, (row,
                                                                                         seconds)
    # iteration 2 evaluated and saved after its row: both are in iteration 3's window
    assert [("eval_seconds" in r, "save_seconds" in r) for r in train] == [
        (False, False), (False, False), (True, True), (False, False)]
    assert 1.0 <= train[2]["eval_seconds"] < 3.0 and 1.0 <= train[2]["save_seconds"] < 5.0
    assert [r["iteration"] for r in valid] == [2, 4]
    assert all(1.0 <= r["validation_seconds"] < 3.0 for r in valid)
