"""One record, one internal vocabulary; each sink writes its conventional names from the
one table: JSONL keys, TensorBoard/W&B tags (Megatron-LM's) and the console line."""

import json

from megatron_jreg.training import metrics
from megatron_jreg.training.metrics import TRAIN, VALIDATION, ConsoleSink, JsonlSink

TRAIN_VALUES = {
    "consumed_samples": 16, "consumed_tokens": 1024, "lm_loss": 5.5, "jreg_penalty": 0.25,
    "R": 0.25, "psi": [0.1, 0.2], "zeta_L": 10.0, "zeta_L-1": 10.0, "zeta_L-2": 0.0,
    "lr": 1e-3, "grad_norm": 1.5, "tokens_per_s": 12345.6, "tflops_per_gpu": None,
    "memory_gib": 0.5, "skipped": None,
}


def test_console_lines(capsys):
    sink = ConsoleSink(train_iters=10)
    sink.write(TRAIN, 2, TRAIN_VALUES)
    sink.write(VALIDATION, 2, metrics.validation_summary(5.0, [0.1, 0.3], 2))
    train, valid = capsys.readouterr().out.splitlines()
    assert train == ("iteration        2/10 | consumed tokens         1024 | lm loss 5.500000 | "
                     "jreg penalty 0.250000 | zeta_L 10.000 | lr 1.000e-03 | grad norm 1.500 | "
                     "tokens/s 12,346 | mem 0.50 GiB")
    assert valid == "validation at iteration 2 | lm loss 5.000000 | ppl 148.413 | zeta_L 20.000"


def test_jsonl_keys_and_null(tmp_path):
    sink = JsonlSink(str(tmp_path / "m.jsonl"))
    sink.write(TRAIN, 2, dict(TRAIN_VALUES, grad_norm=float("nan")))
    sink.write(VALIDATION, 2, metrics.validation_summary(5.0, [0.1, 0.3], 2))
    train, valid = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert list(train) == ["iteration", "consumed_samples", "lm_loss", "jreg_penalty", "R", "psi",
                           "zeta_L", "zeta_L-1", "zeta_L-2", "lr", "grad_norm", "tokens_per_s",
                           "memory_gib"]
    assert train["grad_norm"] is None and train["psi"] == [0.1, 0.2]
    assert list(valid) == ["iteration", "validation_lm_loss", "validation_psi", "validation_zeta_L"]


def test_tensorboard_tags():
    tags = metrics.scalars(TRAIN, TRAIN_VALUES)
    assert set(tags) == {"lm loss", "jreg/penalty", "jreg/R", "jreg/psi/layer_01",
                         "jreg/psi/layer_02",
                         "jreg/zeta_L", "jreg/zeta_L-1", "jreg/zeta_L-2", "learning-rate",
                         "grad-norm", "throughput/tokens_per_s", "memory/GiB"}
    assert tags["jreg/psi/layer_02"] == 0.2
    assert set(metrics.scalars(VALIDATION, metrics.validation_summary(5.0, [0.1, 0.3], 2))) == {
        "validation/lm loss", "validation/zeta_L"}
