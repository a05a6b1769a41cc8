"""Trainer variants against independent references: a weighted data blend is drawn in its
proportions, the JREG weightings/alpha/kernels reach the logged R and the gradient, and
activation recomputation (full uniform/block, selective) trains exactly as without it.

Runs go through ``megatron_jreg.train`` in a process of their own (forked from one that has
imported the trainer: tests/forked_trainer.py), wrapped by a small driver that records,
without changing anything, what the trainer fed its train steps and how often megatron-core
checkpointed and replayed layers (so "same numbers as without recompute" cannot pass by
recompute silently not happening)."""

import json
import math
import random

import pytest
from trainer_runs import base_args, read_metrics, run_env, train

import forked_trainer
from megatron_jreg.jreg import regularizer

# Runs the trainer as `python -m megatron_jreg.train` does, recording on the side:
#   batches: per train step, the tokens of each micro-batch (trainer.rank_microbatches)
#   checkpoint_calls: forward calls of megatron-core's tensor_parallel.checkpoint
#   recomputed: {layer: JregTracker.observe calls made while a checkpoint replays it}
#   dataset_index: the train BlendedDataset's dataset_index (which dataset each sample is from)
DRIVER = r'''
import collections, json, sys
import torch
import megatron.core.tensor_parallel as tp
from megatron.core.tensor_parallel import random as tp_random
import megatron_jreg.training.trainer as trainer
import megatron_jreg.train as train
from megatron_jreg.model import jreg_layer

record = {"batches": [], "checkpoint_calls": 0, "recomputed": collections.Counter()}

original_batches = trainer.rank_microbatches
def rank_microbatches(dataset, start, *args, **kwargs):
    batches = original_batches(dataset, start, *args, **kwargs)
    record["batches"].append({"start": start, "tokens": [b["tokens"].tolist() for b in batches]})
    return batches
trainer.rank_microbatches = rank_microbatches

original_checkpoint = tp.checkpoint
def checkpoint(*args, **kwargs):
    record["checkpoint_calls"] += 1
    return original_checkpoint(*args, **kwargs)
tp.checkpoint = checkpoint

original_observe = jreg_layer.JregTracker.observe
def observe(self, layer_number, h_prev, h_next):
    if tp_random.is_checkpointing() and torch.is_grad_enabled():
        record["recomputed"][layer_number] += 1
    return original_observe(self, layer_number, h_prev, h_next)
jreg_layer.JregTracker.observe = observe

original_build_data = trainer.Trainer._build_data
def build_data(self):
    original_build_data(self)
    index = getattr(self.train_ds, "dataset_index", None)  # a weighted blend's BlendedDataset
    record["dataset_index"] = None if index is None else [int(i) for i in index]
trainer.Trainer._build_data = build_data

code = train.main(sys.argv[2:])
with open(sys.argv[1], "w") as f:
    json.dump(record, f)
sys.exit(code)
'''


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    path = tmp_path_factory.mktemp("driver") / "record_train.py"
    path.write_text(DRIVER)
    return path


def recorded_train(driver, argv, record_path, timeout=600):
    proc = forked_trainer.run_tool(driver, [record_path, *argv], run_env(), timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    return json.loads(record_path.read_text())


def same(got, want, rel):
    """Element-wise equal within rel (lists of equal length, or numbers)."""
    if isinstance(want, list):
        return len(got) == len(want) and all(same(g, w, rel) for g, w in zip(got, want))
    return got == pytest.approx(want, rel=rel, abs=1e-12)


# ---- 1. weighted blends ----------------------------------------------------------------------
# Two corpora over disjoint byte alphabets (EOD aside): a sample's tokens say where it came from.
A_CHARS, A_SEP = "abcdefgh", " "
B_CHARS, B_SEP = "0123456789", "-"
A_BYTES = set((A_CHARS + A_SEP).encode())
B_BYTES = set((B_CHARS + B_SEP).encode())
EOD = 256  # ByteTokenizer's
BLEND_STEPS, BLEND_GLOBAL_BATCH = 10, 16
BLEND_SAMPLES = BLEND_STEPS * BLEND_GLOBAL_BATCH


def _write_corpus(path, chars, sep, seed, docs=300):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(docs):
            words = ("".join(rng.choice(chars) for _ in range(rng.randint(2, 8)))
                     for _ in range(rng.randint(40, 120)))
            f.write(json.dumps({"text": sep.join(words)}) + "\n")


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("blend_data")
    prefixes = []
    for name, chars, sep, seed in (("a", A_CHARS, A_SEP, 1), ("b", B_CHARS, B_SEP, 2)):
        _write_corpus(root / f"{name}.jsonl", chars, sep, seed)
        proc = forked_trainer.run_tool(
            "tools/preprocess_data.py",
            ["--input", root / f"{name}.jsonl", "--output-prefix", root / name,
             "--tokenizer-type", "ByteTokenizer", "--append-eod", "--workers", "1"],
            run_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        prefixes.append(str(root / name) + "_text_document")
    return prefixes


def _blend_argv(prefix_a, prefix_b, weight_a, metrics):
    argv = base_args("-", train_iters=BLEND_STEPS, global_batch_size=BLEND_GLOBAL_BATCH,
                     micro_batch_size=8, metrics_file=metrics)
    at = argv.index("--data-path")
    argv[at + 1:at + 2] = [str(weight_a), prefix_a, str(round(1.0 - weight_a, 6)), prefix_b]
    return argv


def _provenance(tokens):
    """0 for a sample of dataset A, 1 for B; fails on a sample mixing both or neither."""
    seen = set(tokens) - {EOD}
    if seen and seen <= A_BYTES:
        return 0
    if seen and seen <= B_BYTES:
        return 1
    raise AssertionError(f"a sample from neither or both corpora: bytes {sorted(seen)}")


@pytest.fixture(scope="module")
def blend_runs(two_corpora, driver, tmp_path_factory):
    """{weight of A: (per-sample provenance of every trained sample in order, the trainer's
    BlendedDataset.dataset_index, metrics rows)} for real trainer runs on 0.7 A 0.3 B and the
    swapped 0.3 A 0.7 B."""
    root = tmp_path_factory.mktemp("blend_runs")
    runs = {}
    for weight_a in (0.7, 0.3):
        metrics = root / f"m{weight_a}.jsonl"
        record = recorded_train(driver, _blend_argv(*two_corpora, weight_a, metrics),
                                root / f"r{weight_a}.json")
        steps = record["batches"]
        assert [s["start"] for s in steps] == [i * BLEND_GLOBAL_BATCH for i in range(BLEND_STEPS)]
        origin = [_provenance(sample) for s in steps for micro in s["tokens"] for sample in micro]
        runs[weight_a] = (origin, record["dataset_index"], read_metrics(metrics))
    return runs


@pytest.mark.parametrize("weight_a", [0.7, 0.3])
def test_weighted_blend_is_drawn_in_proportion(blend_runs, weight_a):
    """Every trained sample is from one corpus (read from its bytes); the share of A is its
    weight. megatron-core's blending is deterministic and greedy (each sample goes to the
    dataset furthest below its target count), so after every step, not only at the end, the
    count of A samples is within 1 of weight x samples; 2 is allowed (1.25% of 160). The
    swapped weights give the swapped share (112 vs 48 of 160: far outside the tolerance).
    And the samples trained on are the trainer's BlendedDataset's, in its index order."""
    origin, dataset_index, rows = blend_runs[weight_a]
    assert len(origin) == BLEND_SAMPLES
    assert [r["iteration"] for r in rows] == list(range(1, BLEND_STEPS + 1))
    assert all(math.isfinite(r["lm_loss"]) for r in rows)
    assert rows[-1]["consumed_samples"] == BLEND_SAMPLES
    for n in range(BLEND_GLOBAL_BATCH, BLEND_SAMPLES + 1, BLEND_GLOBAL_BATCH):
        count_a = origin[:n].count(0)
        assert abs(count_a - weight_a * n) <= 2, (n, count_a, weight_a)
    assert origin.count(0) / BLEND_SAMPLES == pytest.approx(weight_a, abs=2 / BLEND_SAMPLES)
    assert dataset_index is not None, "the trainer built no BlendedDataset for a weighted blend"
    assert dataset_index[:BLEND_SAMPLES] == origin


# ---- 2. weightings, alpha and kernels ----------------------------------------------------------
L = 4  # the tiny preset's layers
STRONG_LAMBDA = 20.0


def expected_weights(weighting, alpha, num_layers=L):
    """The paper's layer weights written out, not through megatron_jreg.jreg."""
    if weighting == "softmax":  # w_l = exp(alpha l) / sum_k exp(alpha k)
        raw = [math.exp(alpha * l) for l in range(1, num_layers + 1)]
    elif weighting == "power":  # w_l = (l / L)^alpha / sum_k (k / L)^alpha
        raw = [(l / num_layers) ** alpha for l in range(1, num_layers + 1)]
    elif weighting == "final":  # the last layer only
        raw = [0.0] * (num_layers - 1) + [1.0]
    else:
        raise ValueError(weighting)
    return [r / sum(raw) for r in raw]


# name: (weighting, alpha, impl)
VARIANTS = {
    "softmax-torch": ("softmax", 1.0, "torch"),
    "softmax-fused": ("softmax", 1.0, "fused"),
    "softmax-alpha2.5": ("softmax", 2.5, "auto"),
    "power-alpha2": ("power", 2.0, "auto"),
    "power-alpha-0.5": ("power", -0.5, "torch"),
    "final": ("final", 1.0, "auto"),
}


@pytest.fixture(scope="module")
def variant_runs(demo_data, tmp_path_factory):
    """3 fp32 steps with lambda 20 per variant, constant lr: {name: metrics rows}."""
    root = tmp_path_factory.mktemp("variants")
    rows = {}
    for name, (weighting, alpha, impl) in VARIANTS.items():
        metrics = root / f"{name}.jsonl"
        train(base_args(demo_data, train_iters=3, lr_decay_style="constant",
                        jreg_lambda=STRONG_LAMBDA, jreg_weighting=weighting, jreg_alpha=alpha,
                        jreg_impl=impl, metrics_file=metrics))
        rows[name] = read_metrics(metrics)
        assert len(rows[name]) == 3, name
    return rows


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logged_R_is_the_weighted_displacement(variant_runs, name):
    """Per step: R = sum_l w_l(alpha) Psi_l from the logged Psi with the weights written out
    here, and the penalty is lambda R."""
    weighting, alpha, _ = VARIANTS[name]
    weights = expected_weights(weighting, alpha)
    for row in variant_runs[name]:
        assert len(row["psi"]) == L and all(p > 0 for p in row["psi"])
        assert row["R"] == pytest.approx(regularizer(row["psi"], weights), rel=1e-6), row
        assert row["jreg_penalty"] == pytest.approx(STRONG_LAMBDA * row["R"], rel=1e-6), row


def test_the_math_modules_weights_are_the_formulas():
    from megatron_jreg.jreg import layer_weights

    for weighting, alpha, _ in VARIANTS.values():
        got = layer_weights(L, alpha, weighting).tolist()
        assert got == pytest.approx(expected_weights(weighting, alpha), rel=1e-6, abs=1e-9)


def test_fused_and_torch_kernels_train_alike(variant_runs):
    fused, torch_rows = variant_runs["softmax-fused"], variant_runs["softmax-torch"]
    for a, b in zip(torch_rows, fused):
        for key in ("lm_loss", "psi", "R", "grad_norm"):
            assert same(b[key], a[key], rel=1e-5), (key, a[key], b[key])


def test_weighting_and_alpha_reach_the_gradient(variant_runs):
    """Step 1 (same weights, same data) logs the same loss and Psi in every variant; by step
    3 each weighting and alpha has moved the model its own way (lambda 20)."""
    first = variant_runs["softmax-torch"][0]
    for name, rows in variant_runs.items():
        assert same(rows[0]["lm_loss"], first["lm_loss"], rel=1e-5), name
        assert same(rows[0]["psi"], first["psi"], rel=1e-4), name

    def apart(x, y):
        a, b = variant_runs[x][-1], variant_runs[y][-1]
        return max(abs(p - q) / max(abs(p), abs(q)) for p, q in zip(a["psi"], b["psi"]))

    for x, y in (("softmax-torch", "final"), ("softmax-torch", "softmax-alpha2.5"),
                 ("softmax-torch", "power-alpha2"), ("power-alpha2", "power-alpha-0.5")):
        assert apart(x, y) > 0.02, (x, y, variant_runs[x][-1]["psi"], variant_runs[y][-1]["psi"])


# ---- 3. activation recomputation ---------------------------------------------------------------
RECOMPUTE_STEPS, MICROBATCHES = 3, 2  # base_args: micro-batch 4, global batch 8


def _recompute_argv(demo_data, metrics, **recompute):
    # local layers: the checkpoint counts below are megatron-core's own recompute paths
    return base_args(demo_data, train_iters=RECOMPUTE_STEPS, jreg_lambda=1.0,
                     transformer_impl="local", metrics_file=metrics, **recompute)


@pytest.fixture(scope="module")
def no_recompute_run(demo_data, driver, tmp_path_factory):
    root = tmp_path_factory.mktemp("no_recompute")
    record = recorded_train(driver, _recompute_argv(demo_data, root / "m.jsonl"), root / "r.json")
    assert record["checkpoint_calls"] == 0 and not record["recomputed"]
    return read_metrics(root / "m.jsonl")


FORWARDS = RECOMPUTE_STEPS * MICROBATCHES
RECOMPUTE = {
    # (flags, checkpoint calls per forward, layers replayed in backward)
    "full-uniform-2": (dict(recompute_granularity="full", recompute_method="uniform",
                            recompute_num_layers=2), 2, [1, 2, 3, 4]),
    "full-block-2": (dict(recompute_granularity="full", recompute_method="block",
                          recompute_num_layers=2), 2, [1, 2]),
    # megatron-core's default selective module: core attention, inside each layer
    "selective": (dict(recompute_granularity="selective"), L, []),
}


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_recompute_trains_as_without_it(demo_data, driver, no_recompute_run, tmp_path, name):
    """Same per-step LM loss, Psi, R and gradient norm as without recompute (lambda 1, fp32):
    the penalty's gradient survives the replay. And recompute did happen as asked: uniform
    checkpoints 2 chunks of 2 layers and replays all 4, block checkpoints and replays layers
    1-2 only, selective checkpoints each layer's core attention and replays no whole layer."""
    flags, calls_per_forward, replayed = RECOMPUTE[name]
    record = recorded_train(driver, _recompute_argv(demo_data, tmp_path / "m.jsonl", **flags),
                            tmp_path / "r.json")
    assert record["checkpoint_calls"] == calls_per_forward * FORWARDS, record["checkpoint_calls"]
    assert {int(k): v for k, v in record["recomputed"].items()} == {l: FORWARDS for l in replayed}
    rows = read_metrics(tmp_path / "m.jsonl")
    assert len(rows) == len(no_recompute_run) == RECOMPUTE_STEPS
    for a, b in zip(no_recompute_run, rows):
        for key in ("lm_loss", "psi", "R", "jreg_penalty", "grad_norm"):
            assert same(b[key], a[key], rel=1e-5), (name, key, a[key], b[key])
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
