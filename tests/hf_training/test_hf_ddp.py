"""JREG under data parallelism on 2 gloo ranks (CPU): JregTrainer (transformers.Trainer,
which accelerate wraps in DDP), a plain loop around ``DistributedDataParallel``, and FSDP
(FSDP2's ``fully_shard`` and FSDP1's ``FullyShardedDataParallel``) in a plain loop.

The 2 rows of test_hf_penalty.py's ``batch()`` are split one per rank (tests/hf_training/
ddp_worker.py, one ``torch.distributed.run`` launch for every case). Each rank's penalty and
Psi are those of the definitions (``reference_penalty``) on its own row, and the parameters
after one SGD step (lr 1) are those of the step taken by hand in this process on what the
ranks together minimize: DDP and FSDP average the ranks' gradients, so the objective is the
mean over the ranks of each rank's loss, each rank's penalty counting its own row's tokens.
The Trainer's log (reported by rank 0) holds the mean over the ranks of their values.

The Trainer cannot run FSDP on the CPU (accelerate 1.16.0), so the FSDP cases are plain
loops: ``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...}, use_cpu=True)`` (or
the deprecated ``fsdp="full_shard"``) trains, but as DDP (the ``trainer_fsdp`` case checks
it): ``AcceleratorState`` switches to ``DistributedType.FSDP`` only from the MULTI_GPU / MLU
/ SDAA / MUSA / NPU / XPU / HPU / NEURON types, and on MULTI_CPU it drops the FSDP plugin
without a word (``trainer.model_wrapped`` is a ``DistributedDataParallel``).
``fsdp_config={"version": 1, ...}`` stops first, in ``FullyShardedDataParallelPlugin``:
``RuntimeError: FSDP parameter initialization with `sync_module_states=True` is not supported
on cpu.``; with ``sync_module_states`` and ``cpu_ram_efficient_loading`` False it also runs
as DDP.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch
from test_hf_penalty import batch, model_of, reference_penalty

from training.trainer_runs import REPO, run_env

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "ddp_worker.py")
LAM, ALPHA = 0.5, 1.0  # ddp_worker.py's
RANKS = 2
NORM = "model.norm"  # the Llama final norm's path (test_hf_penalty.ARCHS)
CASES = ("trainer_avg", "trainer_local", "trainer_fsdp", "ddp", "fsdp2", "fsdp1")
PLAIN = ("ddp", "fsdp2", "fsdp1")
TIMEOUT = 240


def launch(out):
    """The worker under ``torch.distributed.run --standalone`` (a free port of its own), in a
    process group of its own: on a timeout the launcher and both ranks are killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(RANKS), WORKER, out]
    proc = subprocess.Popen(cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the 2-rank worker ran past {TIMEOUT} s:\n{output[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"the 2-rank worker failed ({proc.returncode}):\n{output[-8000:]}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{case: [rank 0's result, rank 1's result]} (ddp_worker.py's records)."""
    out = tmp_path_factory.mktemp("hf_ddp")
    launch(str(out))
    return {case: [torch.load(out / f"{case}.rank{r}.pt", weights_only=False)
                   for r in range(RANKS)] for case in CASES}


def row_of(input_ids):
    """The row of ``batch()`` a rank trained on."""
    ids, _ = batch()
    [row] = [i for i in range(len(ids)) if torch.equal(ids[i:i + 1], input_ids)]
    return row


def row_batch(i):
    ids, mask = batch()
    ids, mask = ids[i:i + 1], mask[i:i + 1]
    return ids, mask, ids.masked_fill(mask == 0, -100)


def targets(i):
    """The LM loss's targets in row i: its real labels after the causal shift (9 - 1 = 8
    and 6 - 1 = 5)."""
    return int((row_batch(i)[2][:, 1:] != -100).sum())


def row_terms(model, i):
    """(the model's mean CE over row i's targets, lambda * R of row i, Psi of row i): one
    process, the definitions."""
    ids, mask, labels = row_batch(i)
    lm = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    penalty, psi = reference_penalty(model, NORM, ids, mask, LAM, ALPHA)
    return lm, penalty.float(), psi.float()


# What the ranks minimize together, written per row; DDP (and FSDP) average the ranks'
# gradients, so each objective is the mean over the ranks of rank i's loss on row i.
#
# "rank_mean": rank i's loss is its row's mean CE plus its row's penalty:
#     mean_i (lm_i + penalty_i)
# (the plain loops, and the Trainer with average_tokens_across_devices=False: its
# num_items_in_batch is the rank's own target count n_i, so the model's loss is
# sum CE_i / n_i = lm_i).
#
# "token_mean_lm": the Trainer with average_tokens_across_devices=True (the default) gathers
# num_items_in_batch over the ranks, N = n_0 + n_1 = 13 targets, the model returns
# sum CE_i / N, and Trainer.compute_loss multiplies it by the number of processes (2) so
# that DDP's average gives sum CE / N; the mixin adds the penalty unscaled (no gradient
# accumulation here), so rank i's loss is 2 sum CE_i / N + penalty_i and
#     mean_i (2 sum CE_i / N + penalty_i) = (sum_i n_i lm_i) / N + mean_i penalty_i:
# the LM loss of the 2-row batch (token mean), plus the mean of the rows' penalties.
#
# Neither is the one-process step on the 2-row batch (per_device_train_batch_size=2 in one
# process, test_hf_trainer.py): there the penalty is one token mean over both rows' 15 real
# tokens, here the mean of two rows' token means (9 and 6 tokens); "batch_penalty" is that
# step, which the test tells apart.
def objective(model, kind):
    (lm0, pen0, _), (lm1, pen1, _) = row_terms(model, 0), row_terms(model, 1)
    n0, n1 = targets(0), targets(1)
    if kind == "rank_mean":
        return ((lm0 + pen0) + (lm1 + pen1)) / 2
    lm = (n0 * lm0 + n1 * lm1) / (n0 + n1)
    if kind == "token_mean_lm":
        return lm + (pen0 + pen1) / 2
    if kind == "batch_penalty":
        ids, mask = batch()
        return lm + reference_penalty(model, NORM, ids, mask, LAM, ALPHA)[0].float()
    if kind == "no_penalty":
        return lm
    raise ValueError(kind)


def one_process_step(kind):
    """The parameters after one SGD step (lr 1) on ``objective(kind)``, in this process."""
    model, _ = model_of("llama")
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    objective(model, kind).backward()
    opt.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.fixture(scope="module")
def reference():
    model, _ = model_of("llama")
    model.train()
    rows = {}
    with torch.no_grad():
        for i in (0, 1):
            lm, penalty, psi = row_terms(model, i)
            rows[i] = {"lm": float(lm), "penalty": float(penalty), "psi": psi, "n": targets(i)}
    steps = {kind: one_process_step(kind)
             for kind in ("rank_mean", "token_mean_lm", "batch_penalty", "no_penalty")}
    return rows, steps


def assert_params(got, want, what):
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{what}: {name}: {m}")


def distance(a, b):
    return max(float((a[name] - b[name]).abs().max()) for name in b)


def rows_of(results):
    """The row each rank trained on; the 2 ranks trained on the 2 rows, one each."""
    rows = []
    for result in results:
        [seen] = result["seen"]  # one micro-batch of one row per rank
        rows.append(row_of(seen["input_ids"]))
    assert sorted(rows) == [0, 1], rows
    return rows


@pytest.mark.parametrize("case", ["trainer_avg", "trainer_local", "trainer_fsdp"])
def test_the_trainer_logs_the_rank_mean_of_each_rows_penalty(ranks, reference, case):
    """Each rank's penalty is its own row's (the one-process penalty of that row); the log,
    which only rank 0 reports, is the mean over the ranks: every rank logs the same."""
    rows, _ = reference
    results = ranks[case]
    assert [r["wrapper"] for r in results] == ["DistributedDataParallel"] * RANKS
    assert [r["distributed_type"] for r in results] == ["DistributedType.MULTI_CPU"] * RANKS
    n_all = rows[0]["n"] + rows[1]["n"]
    penalties, psis, lms = [], [], []
    for result, row in zip(results, rows_of(results)):
        want = rows[row]
        # the LM loss this rank computed, by the Trainer's rule (comment above objective())
        [seen] = result["seen"]
        if case != "trainer_local":
            assert seen["num_items_in_batch"] == n_all == 13
            lms.append(RANKS * want["lm"] * want["n"] / n_all)
        else:
            assert seen["num_items_in_batch"] == want["n"]
            lms.append(want["lm"])
        penalties.append(want["penalty"])
        psis.append(want["psi"])
    for result in results:
        log = result["log"]
        assert log["jreg_penalty"] == pytest.approx(sum(penalties) / RANKS, rel=1e-5)
        got_psi = torch.tensor([log[f"jreg/psi/layer_{l:02d}"] for l in (1, 2, 3)])
        torch.testing.assert_close(got_psi, sum(psis) / RANKS, rtol=1e-5, atol=1e-7)
        # with token averaging the rank mean is the batch's token-mean LM loss
        assert log["lm_loss"] == pytest.approx(sum(lms) / RANKS, rel=1e-5)
        if case != "trainer_local":
            token_mean = sum(rows[i]["lm"] * rows[i]["n"] for i in (0, 1)) / n_all
            assert log["lm_loss"] == pytest.approx(token_mean, rel=1e-5)
        # the Trainer's loss is its mean of the ranks' losses (gathered)
        assert log["loss"] == pytest.approx(log["lm_loss"] + log["jreg_penalty"], rel=1e-5)
    # the rows' penalties differ, so a log of one rank's row would fail above
    assert abs(penalties[0] - penalties[1]) > 1e-3 * max(penalties)


@pytest.mark.parametrize("case, kind", [("trainer_avg", "token_mean_lm"),
                                        ("trainer_local", "rank_mean"),
                                        ("trainer_fsdp", "token_mean_lm")])
def test_a_trainer_ddp_step_is_the_rank_mean_of_lm_loss_plus_penalty(ranks, reference, case,
                                                                      kind):
    _, steps = reference
    for rank, result in enumerate(ranks[case]):
        assert_params(result["params"], steps[kind], f"{case} rank {rank}")
    # the test tells the objectives apart: the one-process step on the 2-row batch (penalty a
    # token mean over both rows) and a step without the penalty land elsewhere
    got = ranks[case][0]["params"]
    for other in ("batch_penalty", "no_penalty"):
        assert distance(got, steps[other]) > 1e-4, other


def test_the_trainer_runs_fsdp_on_the_cpu_as_ddp(ranks):
    """The fallback of this file's docstring: the Trainer built accelerate's FSDP plugin,
    accelerate dropped it on MULTI_CPU and wrapped the model in DDP (the step above is then
    the DDP step). Fails once accelerate shards on the CPU: then that is an FSDP step."""
    for result in ranks["trainer_fsdp"]:
        assert result["fsdp_asked"] and not result["fsdp_plugin_kept"]
        assert (result["wrapper"], result["distributed_type"]) == (
            "DistributedDataParallel", "DistributedType.MULTI_CPU")


@pytest.mark.parametrize("case", PLAIN)
def test_a_plain_loop_under_ddp_and_fsdp(ranks, reference, case):
    """Each rank's penalty is its row's; the step is the rank mean of (LM + penalty)."""
    rows, steps = reference
    results = ranks[case]
    for result, row in zip(results, rows_of(results)):
        assert result["penalty"] == pytest.approx(rows[row]["penalty"], rel=1e-5)
        torch.testing.assert_close(result["psi"], rows[row]["psi"], rtol=1e-5, atol=1e-7)
        assert result["lm_loss"] == pytest.approx(rows[row]["lm"], rel=1e-5)
    for rank, result in enumerate(results):
        assert_params(result["params"], steps["rank_mean"], f"{case} rank {rank}")
    assert distance(results[0]["params"], steps["batch_penalty"]) > 1e-4


def test_the_decoder_layers_are_found_inside_each_wrapper(ranks):
    """HFJreg finds the layers through DDP's ``.module``; on an FSDP2 model the layers' class
    is fully_shard's ``FSDPLlamaDecoderLayer`` (one class: still found); under FSDP1 each
    layer is a ``FullyShardedDataParallel`` wrapper in the ModuleList (one class, the
    config's count: still found, inside the root wrapper's ``_fsdp_wrapped_module``)."""
    want = {
        "trainer_avg": ("DistributedDataParallel", "model.layers", ["LlamaDecoderLayer"]),
        "ddp": ("DistributedDataParallel", "model.layers", ["LlamaDecoderLayer"]),
        "fsdp2": ("FSDPLlamaForCausalLM", "model.layers", ["FSDPLlamaDecoderLayer"]),
        "fsdp1": ("FullyShardedDataParallel", "_fsdp_wrapped_module.model.layers",
                  ["FullyShardedDataParallel"]),
    }
    for case, (wrapper, path, classes) in want.items():
        for result in ranks[case]:
            assert (result["wrapper"], result["layers"]["path"],
                    result["layers"]["classes"]) == (wrapper, path, classes), case


@pytest.mark.parametrize("case", ["fsdp2", "fsdp1"])
def test_an_fsdp_step_equals_the_ddp_step(ranks, case):
    for rank in range(RANKS):
        assert_params(ranks[case][rank]["params"], ranks["ddp"][rank]["params"],
                      f"{case} against ddp, rank {rank}")
