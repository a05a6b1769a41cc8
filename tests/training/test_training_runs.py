"""End-to-end trainer runs on the demo data: parallel equality, resume, logging, bf16 and fp16.

Learning and JREG's effect over the README demo's 300 steps: tests/training/test_example_scripts.py
runs examples/demo.sh as written.
"""

import pytest
from trainer_runs import base_args, read_metrics, train


@pytest.fixture(scope="module")
def single_rank_12_steps(demo_data, tmp_path_factory):
    metrics = tmp_path_factory.mktemp("tp1") / "ref.jsonl"
    train(base_args(demo_data, metrics_file=metrics, train_iters=12))
    return read_metrics(metrics)


@pytest.mark.parametrize("layout", [
    {"tensor_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2},
    {"tensor_model_parallel_size": 2, "sequence_parallel": True, "use_distributed_optimizer": True},
])
def test_parallel_runs_match_single_rank(demo_data, single_rank_12_steps, tmp_path, layout):
    """Same seed and data, 12 steps: the model does not depend on the layout. The byte
    tokenizer's 259 ids pad to 384 rows at every TP size (Megatron-LM's padding to
    128 x TP gives 256 rows at TP1 and 512 at TP2: a different model, 5.207 vs 5.487)."""
    got = tmp_path / "par.jsonl"
    train(base_args(demo_data, metrics_file=got, train_iters=12, **layout), nproc=2)
    ref_rows, got_rows = single_rank_12_steps, read_metrics(got)
    assert len(ref_rows) == len(got_rows) == 12
    for a, b in zip(ref_rows, got_rows):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["jreg_penalty"] == pytest.approx(a["jreg_penalty"], rel=1e-4)
        assert b["psi"] == pytest.approx(a["psi"], rel=1e-4, abs=1e-6)
    assert ref_rows[-1]["lm_loss"] < ref_rows[0]["lm_loss"] - 0.5  # it trained


def test_resume_keeps_the_checkpoints_padded_vocabulary(demo_data, tmp_path):
    """A checkpoint padded otherwise (here to 512 rows; checkpoints of earlier versions were
    padded per TP size) resumes at another TP with its own rows, recorded in the run config."""
    import yaml

    save = tmp_path / "ckpt"
    train(base_args(demo_data, train_iters=2, lr_decay_iters=4, save=save, save_interval=2,
                    make_vocab_size_divisible_by=512))
    proc = train(base_args(demo_data, train_iters=4, lr_decay_iters=4, save=save, save_interval=2,
                           load=save,
                           tensor_model_parallel_size=2), nproc=2)
    assert "keeping the checkpoint's 512 embedding rows" in proc.stdout
    assert "iteration        4/4" in proc.stdout
    config = yaml.safe_load((save / "iter_0000004" / "run_config.yaml").read_text())
    assert config["model"]["padded_vocab"] == 512
    assert config["model"]["transformer_impl"] in ("local", "transformer_engine")  # resolved


def _tensorboard_scalars(directory):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_log_line_tensorboard_and_metrics_agree(demo_data, tmp_path):
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    out = train(base_args(demo_data, train_iters=4, log_interval=2, eval_interval=4, eval_iters=1,
                          jreg_lambda=0.0, metrics_file=metrics, tensorboard_dir=tb)).stdout
    lines = [l for l in out.splitlines() if l.startswith("iteration ")]
    assert len(lines) == 2
    for field in ("consumed tokens", "lm loss", "jreg penalty", "zeta_L", "lr", "grad norm",
                  "tokens/s", "mem"):
        assert f"| {field} " in lines[-1], lines[-1]
    assert "validation at iteration 4 | lm loss" in out and out.strip().splitlines()[-1].startswith(
        "done:")
    rows = read_metrics(metrics)
    scalars = _tensorboard_scalars(tb)
    expected = {"lm loss", "jreg/penalty", "jreg/zeta_L", "jreg/zeta_L-1", "jreg/zeta_L-2",
                "validation/lm loss"} | {f"jreg/psi/layer_{i:02d}" for i in range(1, 5)}
    assert expected <= set(scalars), sorted(scalars)
    assert scalars["lm loss"] == pytest.approx([r["lm_loss"] for r in rows], rel=1e-6)
    # a baseline (lambda = 0) still logs every layer's displacement
    assert scalars["jreg/psi/layer_04"] == pytest.approx([r["psi"][3] for r in rows], rel=1e-6)
    assert all(v > 0 for v in scalars["jreg/psi/layer_04"])
    for key in ("iteration", "lm_loss", "jreg_penalty", "psi", "zeta_L", "lr", "grad_norm",
                "tokens_per_s"):
        assert key in rows[-1]


@pytest.fixture(scope="module")
def fp32_lambda_runs(demo_data, tmp_path_factory):
    """fp32 runs of 10 steps without and with a strong JREG (lambda 20), each step's metrics:
    the two ends the reduced-precision runs below are placed between."""
    root = tmp_path_factory.mktemp("fp32_lambda")
    rows = {}
    for name, lam in (("off", 0.0), ("on", 20.0)):
        metrics = root / f"{name}.jsonl"
        train(base_args(demo_data, train_iters=10, metrics_file=metrics, jreg_lambda=lam))
        rows[name] = read_metrics(metrics)
    return rows


def _follows_the_penalty(precision_rows, fp32):
    """The reduced-precision run with lambda 20 follows fp32 with lambda 20, not without."""
    off, on, low = fp32["off"][-1]["R"], fp32["on"][-1]["R"], precision_rows[-1]["R"]
    assert on < 0.8 * off, (on, off)  # the strong penalty moved the fp32 run
    assert abs(low - on) < 0.2 * abs(off - on), (low, on, off)
    assert precision_rows[-1]["psi"] == pytest.approx(fp32["on"][-1]["psi"], rel=0.1, abs=1e-3)


def test_bf16_run_tracks_fp32_and_applies_the_penalty(demo_data, fp32_lambda_runs, tmp_path):
    """bf16 (Float16Module, fp32 main grads) follows the fp32 run step by step, and its
    JREG gradient is applied: with lambda 20 it lands where fp32 with lambda 20 does."""
    metrics = tmp_path / "bf16.jsonl"
    train(base_args(demo_data, train_iters=10, metrics_file=metrics, jreg_lambda=20.0, bf16=True))
    rows = read_metrics(metrics)
    for a, b in zip(fp32_lambda_runs["on"], rows):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=2e-2)
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"]
    _follows_the_penalty(rows, fp32_lambda_runs)


def test_fp16_loss_scale_reaches_the_penalty(demo_data, fp32_lambda_runs, tmp_path):
    """fp16 scales the loss by a dynamic loss scale (2^16 to start here: from the default
    2^32, Megatron-LM's, every step of so short a run overflows and is skipped while the
    scale halves) and unscales gradients in the optimizer; the penalty's injected gradient
    must carry the same scale, or after unscaling JREG does nothing. A strong lambda makes
    the difference plain: the fp16 run follows fp32 with the same lambda, not fp32 without
    JREG."""
    metrics = tmp_path / "fp16.jsonl"
    train(base_args(demo_data, train_iters=10, metrics_file=metrics, jreg_lambda=20.0, fp16=True,
                    initial_loss_scale=2**16))
    _follows_the_penalty(read_metrics(metrics), fp32_lambda_runs)
