"""Our trainer's defaults against Megatron-LM core_v0.16.1's: one row per flag both accept.

A Megatron-LM command line means the same run here: a flag left out takes Megatron-LM's
value, unless ALLOWED says why it may differ (a setting that changes no number of a run, or
a flag Megatron-LM requires, so that it has no default to follow).
"""

import argparse

import pytest

from megatron_jreg.commands import flags
from megatron_jreg.commands.train import from_argv
from megatron_jreg.config.run import SECTIONS

# The flags Megatron-LM requires (its validate_args and pretrain_gpt.py stop without them),
# launched on two processes: one tensor- and pipeline-parallel rank, so data-parallel size 2.
REQUIRED = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 2 --train-iters 10 --lr 1e-4 "
            "--data-path x").split()
WORLD_SIZE = 2

# Megatron-LM core_v0.16.1's value of every flag both trainers accept, for the command line
# REQUIRED launched with WORLD_SIZE=2. Read from its argument parser (megatron/training/
# arguments.py: parse_args, whose _add_*_args take their defaults from the config dataclasses
# of training_config.py, common_config.py, resilience_config.py and megatron-core's) and
# validate_args, which derives the rest (--global-batch-size = micro batch x data-parallel
# size, --split with --data-path, --ffn-hidden-size, --kv-channels, --add-qkv-bias with
# biases, rope fusion off without RoPE). In a Megatron-LM checkout at core_v0.16.1:
#   sys.argv = ["pretrain_gpt.py", *REQUIRED]; args = parse_args(); validate_args(args)
#   for each flag of ours with an action in add_megatron_arguments(ArgumentParser()):
#       value = getattr(args, action.dest, action.default)
#       (a switch: value == action.const, whether it is in effect when left out;
#        an enum: its name; a flag in REQUIRED: "REQUIRED")
# with WORLD_SIZE=2 in the environment and a stand-in module in sys.modules for
# megatron.core.transformer.custom_layers.batch_invariant_kernels (initialize.py imports it;
# it needs triton, and parsing needs none of it).
MEGATRON_LM = {
    '--num-layers': 'REQUIRED',
    '--hidden-size': 'REQUIRED',
    '--num-attention-heads': 'REQUIRED',
    '--num-query-groups': 1,
    '--ffn-hidden-size': 256,
    '--seq-length': 'REQUIRED',
    '--max-position-embeddings': 'REQUIRED',
    '--vocab-size': None,
    '--make-vocab-size-divisible-by': 128,
    '--rotary-base': 10000,
    '--norm-epsilon': 1e-05,
    '--init-method-std': 0.02,
    '--hidden-dropout': 0.1,
    '--attention-dropout': 0.1,
    '--swiglu': False,
    '--normalization': 'LayerNorm',
    '--use-rotary-position-embeddings': False,
    '--position-embedding-type': 'learned_absolute',
    '--untie-embeddings-and-output-weights': False,
    '--disable-bias-linear': False,
    '--add-qkv-bias': True,
    '--qk-layernorm': False,
    '--group-query-attention': False,
    '--kv-channels': 16,
    '--rotary-percent': 1.0,
    '--attention-backend': 'auto',
    '--attention-softmax-in-fp32': False,
    '--bf16': False,
    '--fp16': False,
    '--transformer-impl': 'transformer_engine',
    '--num-experts': None,
    '--moe-router-topk': 2,
    '--moe-aux-loss-coeff': 0.0,
    '--moe-router-load-balancing-type': 'aux_loss',
    '--moe-router-pre-softmax': False,
    '--moe-ffn-hidden-size': None,
    '--moe-token-dispatcher-type': 'allgather',
    '--moe-grouped-gemm': False,
    '--tensor-model-parallel-size': 1,
    '--pipeline-model-parallel-size': 1,
    '--num-layers-per-virtual-pipeline-stage': None,
    '--num-virtual-stages-per-pipeline-rank': None,
    '--sequence-parallel': False,
    '--overlap-grad-reduce': False,
    '--overlap-param-gather': False,
    '--distributed-timeout-minutes': 10,
    '--context-parallel-size': 1,
    '--cp-comm-type': ['p2p'],
    '--hierarchical-context-parallel-sizes': None,
    '--expert-model-parallel-size': 1,
    '--recompute-granularity': None,
    '--recompute-method': None,
    '--recompute-num-layers': None,
    '--recompute-modules': None,
    '--recompute-activations': False,
    '--lr': 'REQUIRED',
    '--min-lr': 0.0,
    '--lr-warmup-iters': 0,
    '--lr-warmup-samples': 0,
    '--lr-warmup-fraction': None,
    '--lr-warmup-init': 0.0,
    '--lr-decay-iters': None,
    '--lr-decay-samples': None,
    '--lr-decay-style': 'linear',
    '--lr-wsd-decay-iters': None,
    '--lr-wsd-decay-samples': None,
    '--lr-wsd-decay-style': 'exponential',
    '--weight-decay': 0.01,
    '--adam-beta1': 0.9,
    '--adam-beta2': 0.999,
    '--adam-eps': 1e-08,
    '--clip-grad': 1.0,
    '--use-distributed-optimizer': False,
    '--initial-loss-scale': 4294967296,
    '--override-opt-param-scheduler': False,
    '--override-opt_param-scheduler': False,
    '--use-checkpoint-opt-param-scheduler': False,
    '--use-checkpoint-opt_param-scheduler': False,
    '--micro-batch-size': 'REQUIRED',
    '--global-batch-size': 4,
    '--train-iters': 'REQUIRED',
    '--train-samples': None,
    '--rampup-batch-size': None,
    '--eval-interval': None,
    '--eval-iters': 100,
    '--seed': 1234,
    '--exit-signal-handler': False,
    '--exit-signal': 'SIGTERM',
    '--exit-duration-in-mins': None,
    '--exit-interval': None,
    '--calculate-per-token-loss': False,
    '--data-path': 'REQUIRED',
    '--split': '969, 30, 1',
    '--data-cache-path': None,
    '--tokenizer-type': None,
    '--tokenizer-model': None,
    '--vocab-file': None,
    '--merge-file': None,
    '--legacy-tokenizer': False,
    '--dataloader-type': 'single',
    '--eod-mask-loss': False,
    '--reset-position-ids': False,
    '--reset-attention-mask': False,
    '--sft': False,
    '--save': None,
    '--load': None,
    '--save-interval': None,
    '--ckpt-step': None,
    '--no-load-optim': False,
    '--finetune': False,
    '--pretrained-checkpoint': None,
    '--use-checkpoint-args': False,
    '--ckpt-format': 'torch_dist',
    '--dist-ckpt-optim-fully-reshardable': False,
    '--disable-ckpt-fully-parallel-save': False,
    '--ckpt-fully-parallel-save': False,
    '--no-ckpt-fully-parallel-save': False,
    '--ckpt-fully-parallel-load': False,
    '--async-save': False,
    '--use-persistent-ckpt-worker': False,
    '--no-load-rng': False,
    '--log-interval': 100,
    '--tensorboard-dir': None,
    '--wandb-project': None,
    '--wandb-exp-name': None,
    '--wandb-save-dir': None,
    '--use-mcore-models': False,
    '--no-masked-softmax-fusion': False,
    '--no-bias-swiglu-fusion': False,
    '--no-bias-gelu-fusion': False,
    '--no-bias-dropout-fusion': False,
    '--no-rope-fusion': True,
    '--no-persist-layer-norm': False,
    '--no-gradient-accumulation-fusion': False,
    '--no-position-embedding': False,
    '--use-flash-attn': False,
    '--cross-entropy-loss-fusion': False,
    '--apply-layernorm-1p': False,
    '--openai-gelu': False,
    '--squared-relu': False,
    '--quick-geglu': False,
    '--rotary-interleaved': False,
    '--use-rope-scaling': False,
    '--rotary-seq-len-interpolation-factor': None,
    '--apply-residual-connection-post-layernorm': False,
    '--fp32-residual-connection': False,
    '--init-method-xavier-uniform': False,
    '--multi-latent-attention': False,
    '--use-legacy-models': False,
    '--fp8-format': None,
    '--optimizer': 'adam',
    '--decoupled-lr': None,
    '--decoupled-min-lr': None,
    '--weight-decay-incr-style': 'constant',
    '--loss-scale': None,
    '--grad-reduce-in-bf16': False,
    '--accumulate-allreduce-grads-in-fp32': False,
    '--distributed-backend': 'nccl',
    '--use-torch-fsdp2': False,
    '--use-megatron-fsdp': False,
    '--tp-comm-overlap': False,
    '--num-workers': 2,
    '--no-create-attention-mask-in-dataloader': False,
    '--no-mmap-bin-files': False,
    '--num-dataset-builder-threads': 1,
    '--mock-data': False,
    '--log-throughput': False,
    '--timing-log-level': 0,
    '--tensorboard-log-interval': 1,
    '--tensorboard-queue-size': 1000,
    '--log-timers-to-tensorboard': False,
    '--log-validation-ppl-to-tensorboard': False,
    '--log-memory-to-tensorboard': False,
    '--log-params-norm': False,
    '--log-num-zeros-in-grad': False,
    '--profile': False,
    '--profile-step-start': 10,
    '--profile-step-end': 12,
    '--manual-gc': False,
    '--manual-gc-interval': 0,
    '--empty-unused-memory-level': 0,
    '--exit-on-missing-checkpoint': False,
}

# Our flags Megatron-LM core_v0.16.1 does not have (or has only in another form: its
# switches have no --no- spelling).
OURS_ONLY = {
    "--model-preset", "--jreg-lambda", "--jreg-alpha", "--jreg-weighting", "--jreg-impl",
    "--no-bf16", "--no-fp16", "--virtual-pipeline-model-parallel-size", "--no-sequence-parallel",
    "--no-use-distributed-optimizer", "--no-override-opt-param-scheduler",
    "--no-override-opt_param-scheduler", "--no-use-checkpoint-opt-param-scheduler",
    "--no-use-checkpoint-opt_param-scheduler", "--no-exit-signal-handler", "--exit-on-nan",
    "--no-exit-on-nan", "--no-calculate-per-token-loss", "--no-sft", "--no-finetune",
    "--no-dist-ckpt-optim-fully-reshardable", "--no-ckpt-fully-parallel-load",
    "--no-async-save", "--no-use-persistent-ckpt-worker", "--no-verify-checkpoint",
    "--allow-tokenizer-change", "--no-allow-tokenizer-change", "--overwrite-checkpoints",
    "--no-overwrite-checkpoints", "--metrics-file",
}

_REQUIRED_THERE = "required in Megatron-LM: it has no default"
# Where our default may differ from Megatron-LM's, and why. Nothing here changes a number of
# a run that gives Megatron-LM's required flags.
ALLOWED = {
    **{flag: _REQUIRED_THERE for flag in REQUIRED if flag.startswith("--")},
    "--tokenizer-type": "Megatron-LM has no default (building the tokenizer fails without "
                        "--tokenizer-type); ours is the byte tokenizer, which needs no file",
    "--distributed-timeout-minutes": "a safety setting: how long a collective may wait "
                                     "before the run stops (30 here, 10 in Megatron-LM)",
    "--exit-signal-handler": "a safety setting: on here, SIGTERM/SIGINT save a checkpoint "
                             "and exit (--no-exit-signal-handler for Megatron-LM's default)",
    "--transformer-impl": "auto: transformer_engine where Transformer Engine imports, as in "
                          "Megatron-LM, and local where it does not (where Megatron-LM's "
                          "default cannot build a model)",
    "--no-rope-fusion": "the same math fused or not; Megatron-LM turns the fusion off itself "
                        "for a model without RoPE (its default learned positions), here the "
                        "start-up line says whether RoPE is fused",
    "--cp-comm-type": "the same attention over any kind: left out, p2p (Megatron-LM's) with "
                      "Transformer Engine's attention, all_gather (the one kind it has) with "
                      "the SDPA attention, which Megatron-LM does not have",
    "--ckpt-fully-parallel-save": "in Megatron-LM a deprecated spelling that does nothing: "
                                  "the fully parallel save is on by default in both (the "
                                  "--no-ckpt-fully-parallel-save row)",
}

# The value a run uses where a setting leaves it to be derived (Megatron-LM's validate_args
# writes it into the setting itself).
DERIVED = {
    "--ffn-hidden-size": lambda run: run.model.ffn_size,
    "--kv-channels": lambda run: run.model.head_dim,
    "--add-qkv-bias": lambda run: run.model.add_qkv_bias or run.model.add_bias_linear,
}


def _same(flag, ours, theirs) -> bool:
    if flag == "--split":  # "969,30,1" and "969, 30, 1" are the same weights
        return [float(w) for w in ours.split(",")] == [float(w) for w in theirs.split(",")]
    return ours == theirs and type(ours) is type(theirs) or (
        isinstance(ours, (int, float)) and not isinstance(ours, bool)
        and isinstance(theirs, (int, float)) and float(ours) == float(theirs))


@pytest.fixture(scope="module")
def ours():
    """Our value of each flag for the command line REQUIRED on WORLD_SIZE processes: the
    trainer's own parser and config sections, as ``python -m megatron_jreg.train`` reads it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORLD_SIZE", str(WORLD_SIZE))
        run = from_argv(REQUIRED)
    values = {}
    for action in flags.build_parser(SECTIONS)._actions:
        if "." not in action.dest:  # --help, --config
            continue
        section, name = action.dest.split(".", 1)
        value = getattr(getattr(run, section), name)
        for flag in action.option_strings:
            if flag in DERIVED:
                values[flag] = DERIVED[flag](run)
            elif action.nargs == 0:  # a switch: whether it is in effect when left out
                stored = (not flag.startswith("--no-")
                          if isinstance(action, argparse.BooleanOptionalAction) else action.const)
                values[flag] = value == stored
            else:
                values[flag] = value
    return values


def test_every_flag_of_ours_is_in_the_table_or_not_megatron_lms(ours):
    assert set(ours) - OURS_ONLY == set(MEGATRON_LM), (
        "a flag of ours without a row: add Megatron-LM's value to MEGATRON_LM, or the flag "
        "to OURS_ONLY when Megatron-LM has no such flag")
    assert set(ALLOWED) <= set(MEGATRON_LM)


@pytest.mark.parametrize("flag", sorted(MEGATRON_LM))
def test_the_default_is_megatron_lms(ours, flag):
    theirs = MEGATRON_LM[flag]
    same = theirs != "REQUIRED" and _same(flag, ours[flag], theirs)
    if flag in ALLOWED:
        assert not same, f"{flag}: now Megatron-LM's value; drop it from ALLOWED"
        return
    assert same, (f"{flag}: our default {ours[flag]!r}, Megatron-LM's {theirs!r}; make ours "
                  "Megatron-LM's (a recipe that needs another value passes it) or, for a "
                  "setting that changes no number, say why in ALLOWED")
