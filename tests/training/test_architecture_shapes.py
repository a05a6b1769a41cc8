"""Model shapes megatron-core meets only while it builds the model or in its first forward,
refused before any work: one line on stderr naming the flags and values that fit, exit 2,
nothing on stdout (the start-up lines, printed before the model is built, never come).

What the tests prove:
- an odd head size under RoPE (the tiny preset with --hidden-size 68 --num-attention-heads
  4: a head of 17) is refused, suggesting --hidden-size 64 or 72; the code before built the
  model and stopped at the first forward with megatron-core's size mismatch (17 vs 18
  rotary channels) as a traceback; the suggested --hidden-size 72 trains;
- a TP size that does not divide the MLP's inner size (--ffn-hidden-size 191 at TP 2) or
  each expert's (--moe-ffn-hidden-size 63 at TP 2) is refused, suggesting the sizes next
  to it; under torchrun the code before stopped in megatron-core's RowParallelLinear
  ("191 is not divisible by 2") after the imports and process groups. The check comes
  before the world-size check, so one process shows it;
- a --use-checkpoint-args run whose checkpoint has such an MLP meets the same check;
- eval_jump --load's layout check (``check_model_split``, for a TP > 1 under torchrun)
  names an expert MLP size TP does not divide, which it let through before.
"""

import pytest
from trainer_runs import base_args, train

from megatron_jreg.checkpoint.model_loader import check_model_split
from megatron_jreg.config.model import ModelConfig, ParallelConfig
from megatron_jreg.errors import InputError


def refused_before_work(argv) -> str:
    proc = train(argv, check=False, timeout=300)
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-3000:])
    err = proc.stderr
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert proc.stdout == "", proc.stdout  # no start-up line: nothing was built
    return err.split("error: ", 1)[1].rstrip("\n")


def test_odd_head_size_under_rope_is_refused_naming_sizes_that_fit(demo_data):
    err = refused_before_work(base_args(demo_data, hidden_size=68, num_attention_heads=4))
    assert err == ("--hidden-size 68 with --num-attention-heads 4 gives a head size of 17; "
                   "rotary embeddings need an even head size: e.g. --hidden-size 64 or "
                   "--hidden-size 72")
    proc = train(base_args(demo_data, hidden_size=72, num_attention_heads=4, train_iters=1))
    assert "lm loss" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.parametrize("flags, message", [
    ({"ffn_hidden_size": 191},
     "--tensor-model-parallel-size 2 must divide the MLP's inner size 191 (--ffn-hidden-size; "
     "each TP rank holds an equal share): e.g. --ffn-hidden-size 190 or --ffn-hidden-size 192, "
     "or --tensor-model-parallel-size 1"),
    ({"model_preset": "mixtral-tiny", "sequence_parallel": True, "moe_ffn_hidden_size": 63},
     "--tensor-model-parallel-size 2 must divide each expert's MLP inner size 63 "
     "(--moe-ffn-hidden-size; each TP rank holds an equal share): e.g. --moe-ffn-hidden-size "
     "62 or --moe-ffn-hidden-size 64, or --tensor-model-parallel-size 1"),
], ids=["dense", "experts"])
def test_tp_that_does_not_divide_the_mlp_is_refused(flags, message, demo_data):
    argv = base_args(demo_data, tensor_model_parallel_size=2, **flags)
    assert refused_before_work(argv) == message


def test_checkpoint_args_meet_the_same_check(demo_data, tmp_path):
    """--use-checkpoint-args takes the sizes from the checkpoint (no flag changes them), so
    the message's smaller TP is the fix that applies."""
    ckpt = str(tmp_path / "ckpt")
    train(base_args(demo_data, ffn_hidden_size=191, train_iters=1, save=ckpt, save_interval=1))
    argv = base_args(demo_data, model_preset=None, pretrained_checkpoint=ckpt,
                     use_checkpoint_args=True, tensor_model_parallel_size=2)
    assert refused_before_work(argv).startswith(
        "--tensor-model-parallel-size 2 must divide the MLP's inner size 191")


def test_layout_check_of_the_tools_names_the_expert_mlp():
    model = ModelConfig.from_preset("mixtral-tiny", moe_ffn_hidden_size=63, vocab_size=256)
    with pytest.raises(InputError, match="the model's 63 expert FFN size are not divisible by "
                       "--tensor-model-parallel-size 2"):
        check_model_split("ckpt", model, 256, ParallelConfig(tensor_model_parallel_size=2))
    check_model_split("ckpt", model, 256, ParallelConfig(tensor_model_parallel_size=1))
