"""Megatron-LM's flags that need no setting of their own here: the table, in one place.

Each row of ``TABLE`` is one flag: ``ACCEPTED`` (already what happens here), ``NOTED``
(accepted, with a line the trainer prints: :func:`notes`) or ``REFUSED`` (changes the math: the
run stops before any work). The rows become the fields of :class:`MegatronLMConfig`, so the
generated parser takes them; adding a flag is adding a row. ``SECTION_FLAGS`` lists, for the
docs, the Megatron-LM flags that have a setting in a config section.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, NamedTuple, Optional

from megatron_jreg.config import values as config_values
from megatron_jreg.errors import ConfigError

ACCEPTED, NOTED, REFUSED = "accepted", "accepted with a printed line", "refused"


class Row(NamedTuple):
    flag: str
    status: str
    why: str
    kind: type = bool  # bool: a switch; else the value's type
    default: object = False
    choices: Optional[tuple] = None
    allowed: tuple = ()  # values that are accepted silently although the row is NOTED/REFUSED
    nargs: Optional[object] = None
    bounds: Optional[dict] = None  # config.values' range metadata (min, gt, max, lt) of a value


TABLE = [
    # ---- model ----------------------------------------------------------------------------
    Row("--use-mcore-models", ACCEPTED, "megatron-core models are the only models here"),
    Row("--no-masked-softmax-fusion", ACCEPTED, "the masked softmax is never fused here"),
    Row("--no-bias-swiglu-fusion", ACCEPTED, "the local implementation never fuses the MLP "
        "bias with SwiGLU (Transformer Engine's is the same math)"),
    Row("--no-bias-gelu-fusion", ACCEPTED, "the local implementation never fuses the MLP "
        "bias with GeLU (Transformer Engine's is the same math)"),
    Row("--no-bias-dropout-fusion", ACCEPTED, "the local implementation never fuses "
        "bias-dropout-add (Transformer Engine's is the same math)"),
    Row("--no-rope-fusion", ACCEPTED, "as in Megatron-LM: RoPE is otherwise fused where "
        "Transformer Engine builds the layers (its kernel; the start-up line says which)"),
    Row("--no-persist-layer-norm", ACCEPTED, "the persistent layer-norm kernel is never used"),
    Row("--no-gradient-accumulation-fusion", ACCEPTED,
        "as in Megatron-LM: weight gradients are otherwise accumulated inside the GEMM, by "
        "Transformer Engine's linears themselves and by megatron-core's where apex's "
        "fused_weight_gradient_mlp_cuda imports (never on CPUs)"),
    Row("--no-position-embedding", ACCEPTED, "RoPE models have no position embedding (with "
        "learned absolute positions the flag is refused: such a model has no positions)"),
    Row("--use-flash-attn", NOTED, "ignored, as Megatron-LM 0.16 ignores it for megatron-core "
        "models: --attention-backend picks the attention kernel"),
    Row("--cross-entropy-loss-fusion", NOTED, "the LM loss is megatron-core's unfused "
        "vocab-parallel cross entropy (the same loss)"),
    Row("--apply-layernorm-1p", REFUSED, "zero-centred norm weights are not supported yet"),
    Row("--openai-gelu", REFUSED, "the tanh-approximated GeLU is not supported yet (the GeLU "
        "MLP runs the exact GeLU)"),
    Row("--squared-relu", REFUSED, "a squared-ReLU MLP is not supported yet"),
    Row("--quick-geglu", REFUSED, "a GeGLU MLP is not supported yet"),
    Row("--rotary-interleaved", REFUSED, "interleaved RoPE is not supported yet"),
    Row("--use-rope-scaling", REFUSED, "Llama 3.1 RoPE scaling is not supported yet"),
    Row("--rotary-seq-len-interpolation-factor", REFUSED,
        "RoPE interpolation is not supported yet", int, None, bounds={"min": 1}),
    Row("--apply-residual-connection-post-layernorm", REFUSED,
        "post-norm residuals are not supported yet"),
    Row("--fp32-residual-connection", REFUSED, "an fp32 residual stream is not supported yet"),
    Row("--init-method-xavier-uniform", REFUSED, "only the normal init (--init-method-std) is "
        "supported: every weight is drawn layout-invariantly"),
    Row("--multi-latent-attention", REFUSED, "multi-latent attention is not supported yet"),
    Row("--use-legacy-models", REFUSED, "only megatron-core models are built"),
    Row("--fp8-format", REFUSED, "FP8 training is not supported yet", str, None),
    # ---- optimizer and precision -----------------------------------------------------------
    Row("--optimizer", REFUSED, "only Adam (AdamW, decoupled weight decay) is supported", str,
        "adam", ("adam", "sgd", "muon", "dist_muon"), ("adam",)),
    Row("--decoupled-lr", REFUSED, "a separate embedding/output learning rate is not "
        "supported yet", float, None, bounds={"gt": 0}),
    Row("--decoupled-min-lr", REFUSED, "a separate embedding/output learning rate is not "
        "supported yet", float, None, bounds={"min": 0}),
    Row("--weight-decay-incr-style", REFUSED, "the weight decay is constant here", str,
        "constant", ("constant", "linear", "cosine"), ("constant",)),
    Row("--loss-scale", REFUSED, "static loss scaling is not supported; fp16 uses dynamic "
        "scaling (--initial-loss-scale)", float, None, bounds={"gt": 0}),
    Row("--grad-reduce-in-bf16", REFUSED, "gradients are reduced in fp32 under bf16 here"),
    Row("--accumulate-allreduce-grads-in-fp32", ACCEPTED,
        "bf16/fp16 gradients are always accumulated and reduced in fp32 here"),
    # ---- distributed ----------------------------------------------------------------------
    Row("--distributed-backend", NOTED, "the backend follows the device: NCCL on GPUs, gloo "
        "on CPUs", str, "nccl", ("nccl", "gloo")),
    Row("--use-torch-fsdp2", REFUSED, "FSDP is not supported yet; use "
        "--use-distributed-optimizer"),
    Row("--use-megatron-fsdp", REFUSED, "FSDP is not supported yet; use "
        "--use-distributed-optimizer"),
    Row("--tp-comm-overlap", NOTED, "TP communication is not overlapped (it needs Transformer "
        "Engine's userbuffers)"),
    # ---- data -----------------------------------------------------------------------------
    Row("--num-workers", NOTED, "batches are read in the training process (no DataLoader "
        "workers)", int, 2, bounds={"min": 0}),
    Row("--no-create-attention-mask-in-dataloader", ACCEPTED,
        "the dataloader never builds the [s, s] mask, flag or not: the trainer builds the "
        "causal mask itself"),
    Row("--no-mmap-bin-files", NOTED, "the .bin files are memory-mapped"),
    Row("--num-dataset-builder-threads", ACCEPTED, "passed to megatron-core's dataset builder",
        int, 1, bounds={"min": 1}),
    Row("--mock-data", REFUSED, "needs real data: build some with tools/preprocess_data.py "
        "(tools/make_demo_corpus.py makes a corpus)"),
    # ---- logging --------------------------------------------------------------------------
    Row("--log-throughput", ACCEPTED, "every log line shows tokens/s (and TFLOP/s per GPU)"),
    Row("--timing-log-level", NOTED, "there are no timers here; the log line gives tokens/s",
        int, 0, (0, 1, 2), (0,)),
    Row("--tensorboard-log-interval", NOTED, "TensorBoard gets a point every --log-interval "
        "steps", int, 1, None, (1,), bounds={"min": 1}),
    Row("--tensorboard-queue-size", ACCEPTED, "TensorBoard's writer keeps its default queue",
        int, 1000, bounds={"min": 1}),
    Row("--log-timers-to-tensorboard", NOTED, "there are no timers to log"),
    Row("--log-validation-ppl-to-tensorboard", NOTED, "validation perplexity is printed and "
        "validation loss goes to TensorBoard"),
    Row("--log-memory-to-tensorboard", ACCEPTED, "memory goes to TensorBoard on every log step"),
    Row("--log-params-norm", NOTED, "the parameter norm is not computed"),
    Row("--log-num-zeros-in-grad", NOTED, "zeros in the gradient are not counted"),
    Row("--profile", NOTED, "no profiler is started"),
    Row("--profile-step-start", ACCEPTED, "used with --profile only", int, 10, bounds={"min": 0}),
    Row("--profile-step-end", ACCEPTED, "used with --profile only", int, 12, bounds={"min": 0}),
    Row("--manual-gc", NOTED, "Python's garbage collector runs as usual"),
    Row("--manual-gc-interval", ACCEPTED, "used with --manual-gc only", int, 0,
        bounds={"min": 0}),
    Row("--empty-unused-memory-level", NOTED, "PyTorch's cached memory is not emptied between "
        "steps", int, 0, (0, 1, 2), (0,)),
    # ---- checkpoints ----------------------------------------------------------------------
    Row("--exit-on-missing-checkpoint", ACCEPTED, "always so here: a --load that holds no "
        "checkpoint stops the run before any work (unless --pretrained-checkpoint is given)"),
]

# Megatron-LM flags with a setting of their own, by section (for the docs and their test):
# they are read as Megatron-LM reads them; where the value cannot be supported, the
# section's own check refuses it by name.
SECTION_FLAGS: Dict[str, List[str]] = {
    "model": ["--swiglu", "--normalization", "--position-embedding-type",
              "--use-rotary-position-embeddings", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear", "--group-query-attention", "--num-query-groups",
              "--kv-channels", "--rotary-base", "--rotary-percent", "--norm-epsilon",
              "--init-method-std", "--attention-dropout", "--hidden-dropout",
              "--max-position-embeddings", "--make-vocab-size-divisible-by", "--attention-backend",
              "--attention-softmax-in-fp32", "--transformer-impl", "--bf16", "--fp16",
              "--add-qkv-bias", "--qk-layernorm", "--num-experts", "--moe-router-topk",
              "--moe-router-pre-softmax", "--moe-aux-loss-coeff",
              "--moe-router-load-balancing-type", "--moe-ffn-hidden-size",
              "--moe-token-dispatcher-type", "--moe-grouped-gemm"],
    "parallel": ["--context-parallel-size", "--cp-comm-type",
                 "--hierarchical-context-parallel-sizes", "--overlap-grad-reduce",
                 "--overlap-param-gather",
                 "--recompute-activations", "--virtual-pipeline-model-parallel-size",
                 "--num-virtual-stages-per-pipeline-rank",
                 "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel",
                 "--distributed-timeout-minutes", "--expert-model-parallel-size"],
    "optim": ["--lr-warmup-fraction", "--lr-warmup-samples", "--lr-warmup-init",
              "--lr-decay-samples", "--lr-wsd-decay-samples"],
    "training": ["--train-samples", "--rampup-batch-size", "--exit-signal",
                 "--exit-duration-in-mins", "--eval-iters", "--eval-interval",
                 "--global-batch-size"],
    "logging": ["--log-interval"],
    "data": ["--dataloader-type", "--tokenizer-type", "--vocab-file", "--merge-file",
             "--legacy-tokenizer", "--eod-mask-loss", "--reset-position-ids",
             "--reset-attention-mask"],
    "checkpoint": ["--save-interval", "--use-checkpoint-args", "--no-ckpt-fully-parallel-save",
                   "--ckpt-fully-parallel-load", "--async-save", "--use-persistent-ckpt-worker"],
}


def _name(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _field(row: Row):
    meta = {"flag": row.flag, "help": f"Megatron-LM flag, {row.status}: {row.why}",
            **(row.bounds or {})}
    if row.kind is bool:
        meta["const"] = True
    if row.choices:
        meta["choices"] = row.choices
    if row.nargs:
        meta["nargs"] = row.nargs
    kind = bool if row.kind is bool else Optional[row.kind]
    return _name(row.flag), kind, dataclasses.field(default=row.default, metadata=meta)


def _given(row: Row, value) -> bool:
    """The flag was given a value that is not silently accepted."""
    return value != row.default and value not in row.allowed


def _refuse(self) -> None:
    config_values.check_fields(self)  # a bad value is refused as such, before "not supported"
    for row in TABLE:
        if row.status == REFUSED and _given(row, getattr(self, _name(row.flag))):
            value = getattr(self, _name(row.flag))
            shown = row.flag if row.kind is bool else f"{row.flag} {value}"
            raise ConfigError(f"{shown}: not supported: {row.why}")


MegatronLMConfig = dataclasses.make_dataclass(
    "MegatronLMConfig", [_field(row) for row in TABLE], kw_only=True, frozen=True,
    namespace={"__post_init__": _refuse, "__doc__": "Megatron-LM flags: see TABLE."})
MegatronLMConfig.__module__ = __name__


# megatron-core recomputes a layer's input_layernorm and pre_mlp_layernorm only where they
# are modules of their own (transformer_layer.py: not IdentityOp). Transformer Engine's spec
# fuses each into the next linear (TELayerNormColumnParallelLinear, which keeps the norm's
# output for its backward): the dense layer has no norm left to recompute, the MoE layer its
# pre-MLP TENorm. megatron-core accepts the setting silently; the run says so.
_LAYERNORM_FIX = ("--transformer-impl local recomputes the norms; or recompute mlp or "
                  "core_attn instead")
LAYERNORM_RECOMPUTE = (
    "--recompute-modules layernorm: no effect with Transformer Engine (as in Megatron-LM): "
    "its layers fuse each norm into the next linear, which keeps the norm's output for "
    f"backward; {_LAYERNORM_FIX}")
LAYERNORM_RECOMPUTE_MOE = (
    "--recompute-modules layernorm: with Transformer Engine only the MoE layers' pre-MLP norms "
    "are recomputed (as in Megatron-LM): the input norm is fused into the QKV linear, which "
    f"keeps its output for backward; {_LAYERNORM_FIX}")


def notes(experiment, given: Dict[str, Dict[str, object]], impl: str, backend: str) -> List[str]:
    """The lines the trainer prints for this run's Megatron-LM flags.

    given: the settings as given per section (``commands.flags.parse``'s ``given``); impl: the
    resolved transformer implementation; backend: the run's process-group backend ("nccl" or
    "gloo", ``platform.device.backend``).
    """
    out = []
    compat, given_here = experiment.megatron_lm, given.get("megatron_lm", {})
    for row in TABLE:
        name = _name(row.flag)
        value = getattr(compat, name)
        if row.status != NOTED or name not in given_here or value in row.allowed:
            continue
        if row.flag == "--distributed-backend" and value == backend:
            continue
        out.append(f"{row.flag}{'' if row.kind is bool else f' {value}'}: {row.why}")
    model, parallel = experiment.model, experiment.parallel
    if (given.get("parallel", {}).get("sequence_parallel")
            and parallel.tensor_model_parallel_size == 1):
        out.append("--sequence-parallel: turned off at --tensor-model-parallel-size 1, as in "
                   "Megatron-LM")
    saving = given.get("checkpoint", {})
    if saving.get("async_save") and not experiment.checkpoint.use_persistent_ckpt_worker:
        out.append("--async-save: off without --use-persistent-ckpt-worker, as in Megatron-LM: "
                   "checkpoints are saved synchronously (add --use-persistent-ckpt-worker)")
    training = experiment.training
    if (training.eval_iters == 0 and training.eval_interval
            and "eval_interval" in given.get("training", {})):
        # Megatron-LM validates zero batches then: no validation either way, said once here
        out.append(f"--eval-interval {training.eval_interval}: no validation with --eval-iters "
                   "0 (pass --eval-iters 1 or more to validate)")
    groups = given.get("model", {}).get("num_query_groups")
    if groups and not model.group_query_attention and groups != model.num_attention_heads:
        out.append(f"--num-query-groups {groups}: ignored without --group-query-attention, as in "
                   f"Megatron-LM: the attention has {model.num_attention_heads} groups, "
                   "one per head")
    if (impl == "transformer_engine" and parallel.recompute_granularity == "selective"
            and "layernorm" in (parallel.recompute_modules or [])):
        out.append(LAYERNORM_RECOMPUTE_MOE if model.num_experts else LAYERNORM_RECOMPUTE)
    if impl == "local" and model.moe_grouped_gemm:
        out.append("--moe-grouped-gemm: the local implementation runs the experts one by one "
                   "(the same math; Transformer Engine has the grouped GEMM)")
    tp = parallel.tensor_model_parallel_size
    if model.padded_vocab is None and model.vocab_size and tp > 1:
        multiple = model.make_vocab_size_divisible_by
        ours = model.padded_to_multiple()
        theirs = -(-model.vocab_size // (multiple * tp)) * multiple * tp
        if ours != theirs:
            out.append(f"vocabulary padded to {ours} rows, the same under every TP; Megatron-LM "
                       f"pads to {theirs} at TP {tp} (pass --make-vocab-size-divisible-by "
                       f"{multiple * tp} for its model)")
    return out
