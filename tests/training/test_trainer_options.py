"""What the trainer builds from its flags, read from the objects ``Trainer.setup`` makes
(no training step): the optimizer's epsilon and the fp16 loss scale, the timeout handed to
the process group, the loss mask and position ids of the batches it feeds, the LM loss of
--calculate-per-token-loss against a PyTorch computation, the query/key/value bias, the
mixture-of-experts router and experts, the Megatron-LM flags that are noted or accepted,
and every --no-X negation of a setting a --config file turned on.

Setups share the demo data and batch shapes (sequences of 128 tokens, micro-batches of 2,
global batches of 8, one seed), so their batches hold the same tokens."""

import signal

import pytest
import torch
import torch.nn.functional as F
from set_up_trainer import NEGATIONS, RESTORED, negated_config, optimizers, set_up
from trainer_runs import base_args

from megatron_jreg.config import megatron_lm

EOD = 256  # the ByteTokenizer's end-of-document id, appended to every demo document
SHAPES = dict(seq_length=128, micro_batch_size=2, global_batch_size=8)
STEPS = 6  # the global batches compared

# Megatron-LM flags that take a value: one the row prints a line for (NOTED) or takes
# silently (ACCEPTED); the switches are given bare
NOTED_VALUES = {"--distributed-backend": "nccl", "--num-workers": "4",
                "--timing-log-level": "1", "--tensorboard-log-interval": "5",
                "--empty-unused-memory-level": "2"}
ACCEPTED_VALUES = {"--num-dataset-builder-threads": "2", "--tensorboard-queue-size": "50",
                   "--profile-step-start": "3", "--profile-step-end": "4",
                   "--manual-gc-interval": "5"}


def _rows(status):
    return [row for row in megatron_lm.TABLE if row.status == status]


def _given(rows, values):
    argv = []
    for row in rows:
        argv += [row.flag] if row.kind is bool else [row.flag, values[row.flag]]
    return argv


def test_every_valued_table_row_has_a_value_here():
    for status, values in ((megatron_lm.NOTED, NOTED_VALUES),
                           (megatron_lm.ACCEPTED, ACCEPTED_VALUES)):
        assert {r.flag for r in _rows(status) if r.kind is not bool} == set(values)


@pytest.fixture(scope="module")
def measured(demo_data):
    """--adam-eps, --distributed-timeout-minutes, --eod-mask-loss, --reset-position-ids,
    --calculate-per-token-loss, --add-qkv-bias, --no-exit-signal-handler and every NOTED
    and ACCEPTED Megatron-LM flag; the timeouts the trainer asked initialize_distributed for."""
    import megatron_jreg.training.trainer as trainer_module

    asked = []
    real = trainer_module.initialize_distributed

    def initialize_distributed(timeout_minutes=30, *args, **kwargs):
        asked.append(timeout_minutes)
        return real(timeout_minutes, *args, **kwargs)

    argv = base_args(demo_data, **SHAPES, eval_interval=1, eval_iters=1, adam_eps=1e-5,
                     distributed_timeout_minutes=7, eod_mask_loss=True, reset_position_ids=True,
                     calculate_per_token_loss=True, add_qkv_bias=True, no_exit_signal_handler=True)
    argv += _given(_rows(megatron_lm.NOTED), NOTED_VALUES)
    argv += _given(_rows(megatron_lm.ACCEPTED), ACCEPTED_VALUES)
    patch = pytest.MonkeyPatch()
    patch.setattr(trainer_module, "initialize_distributed", initialize_distributed)
    try:
        with set_up(argv) as built:
            patch.undo()
            built.asked_timeouts = asked
            yield built
    finally:
        patch.undo()


@pytest.fixture(scope="module")
def negated(demo_data, tmp_path_factory):
    """The --config file's switches undone on the command line: the plain fp32 run."""
    config = negated_config(tmp_path_factory.mktemp("negated") / "run.yaml")
    argv = base_args(demo_data, **SHAPES, config=config) + list(NEGATIONS) + list(RESTORED)
    with set_up(argv) as built:
        yield built


def _batches(trainer):
    return [trainer._batches(trainer.train_ds, step * SHAPES["global_batch_size"])
            for step in range(STEPS)]


# ---- the optimizer and the process group -------------------------------------------------

def test_adam_eps_is_the_epsilon_of_every_parameter_group(measured):
    model_params = {id(p) for m in measured.trainer.model for p in m.parameters()}
    seen = set()
    for opt in optimizers(measured.trainer):
        adam = opt.optimizer  # the torch optimizer megatron's wraps
        assert isinstance(adam, (torch.optim.Adam, torch.optim.AdamW))
        assert adam.defaults["eps"] == 1e-5
        for group in adam.param_groups:
            assert group["eps"] == 1e-5
            seen |= {id(p) for p in group["params"]}
    assert seen == model_params  # (fp32: the optimizer steps the model's own parameters)


def test_distributed_timeout_minutes_is_what_the_trainer_asks_for(measured):
    # initialize_distributed hands it to init_process_group: test_trainer_option_rules.py
    assert measured.asked_timeouts == [7]


def test_no_exit_signal_handler_leaves_the_handlers_alone(measured, negated):
    assert measured.handlers == measured.before
    # --exit-signal-handler over a --config that turned it off: the trainer's handler
    signals = negated.trainer.signals
    for sig in (signal.SIGTERM, signal.SIGINT):
        assert negated.handlers[sig] == signals._handle


# ---- the batches the trainer feeds -------------------------------------------------------

def _positions_restarting_after_eod(tokens):
    """Megatron-LM's --reset-position-ids: 0, 1, ... counting from the token after the last
    EOD before each position."""
    out, start = [], 0
    for i, token in enumerate(tokens):
        out.append(i - start)
        if token == EOD:
            start = i + 1
    return out


def test_eod_mask_loss_and_reset_position_ids_in_the_batches(measured, negated):
    """Megatron-LM's definitions: no loss at a position whose input token is the EOD (the
    prediction made from it), and position ids that restart after each EOD; the plain run's
    batches of the same tokens keep every loss position and count from 0 to 127."""
    eods = 0
    for masked_step, plain_step in zip(_batches(measured.trainer), _batches(negated.trainer)):
        for masked, plain in zip(masked_step, plain_step):
            assert torch.equal(masked["tokens"], plain["tokens"])
            assert "attention_mask" not in masked  # the trainer makes its own causal mask
            for row in range(masked["tokens"].shape[0]):
                tokens = masked["tokens"][row].tolist()
                eods += tokens.count(EOD)
                assert masked["loss_mask"][row].tolist() == [float(t != EOD) for t in tokens]
                restarted = _positions_restarting_after_eod(tokens)
                assert masked["position_ids"][row].tolist() == restarted
                assert plain["loss_mask"][row].tolist() == [1.0] * len(tokens)
                assert plain["position_ids"][row].tolist() == list(range(len(tokens)))
    assert eods >= 3, "the compared batches hold too few documents' ends to show anything"


def _token_losses(trainer, samples):
    """Cross entropy at every position of each sample, from the trainer's model's logits
    (PyTorch's cross entropy over the whole padded vocabulary, as megatron's)."""
    tokens = torch.stack([s["tokens"] for s in samples])
    s = tokens.shape[1]
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        trainer.model[0].eval()
        logits = trainer.model[0](tokens, torch.stack([s["position_ids"] for s in samples]), causal)
        trainer.model[0].train()
    labels = torch.stack([s["labels"] for s in samples])
    return F.cross_entropy(logits.float().transpose(1, 2), labels, reduction="none")


def test_calculate_per_token_loss_is_the_mean_over_the_batchs_loss_tokens(measured):
    """The trainer's validation LM loss over one global batch of real samples whose first
    micro-batch keeps only its 3 hardest positions per sample: the mean of the token cross
    entropies over all loss positions of the batch (computed here from the model's logits),
    not the mean of the four micro-batches' means."""
    trainer = measured.trainer
    g, mbs = SHAPES["global_batch_size"], SHAPES["micro_batch_size"]
    samples = [{k: torch.as_tensor(v).clone() for k, v in trainer.valid_ds[i].items()}
               for i in range(g)]
    ce = _token_losses(trainer, samples)
    for i in range(mbs):  # the first micro-batch: few loss positions, each a high loss
        keep = torch.zeros_like(samples[i]["loss_mask"])
        keep[ce[i].topk(3).indices] = 1.0
        samples[i]["loss_mask"] = keep
    mask = torch.stack([s["loss_mask"] for s in samples]).float()
    per_token = float((ce * mask).sum() / mask.sum())
    micro = [(ce[i:i + mbs] * mask[i:i + mbs]).sum() / mask[i:i + mbs].sum()
             for i in range(0, g, mbs)]
    mean_of_means = float(sum(micro) / len(micro))
    assert abs(per_token - mean_of_means) > 1e-3 * per_token, (per_token, mean_of_means)
    real = trainer.valid_ds
    trainer.valid_ds = samples  # the trainer indexes it as its dataset
    try:
        got = trainer.evaluate()["lm_loss"]
    finally:
        trainer.valid_ds = real
    assert got == pytest.approx(per_token, rel=1e-5), (got, per_token, mean_of_means)


# ---- the model -----------------------------------------------------------------------------

def test_add_qkv_bias_puts_a_bias_on_the_qkv_projection_only(measured, negated):
    model = measured.trainer.cfg.model
    qkv_rows = (model.num_attention_heads + 2 * model.query_groups) * model.head_dim
    for built, with_bias in ((measured, True), (negated, False)):
        layers = built.trainer.model[0].module.decoder.layers
        assert len(layers) == model.num_layers
        for layer in layers:
            bias = layer.self_attention.linear_qkv.bias
            assert (bias is not None) == with_bias
            if with_bias:
                assert tuple(bias.shape) == (qkv_rows,) and bias.requires_grad
            assert layer.self_attention.linear_proj.bias is None
            assert layer.mlp.linear_fc1.bias is None and layer.mlp.linear_fc2.bias is None


# ---- Megatron-LM's flags that need no setting here ------------------------------------------

def test_noted_flags_print_their_line_once_and_accepted_ones_nothing(measured):
    lines = measured.log.splitlines()
    for row in _rows(megatron_lm.NOTED):
        shown = row.flag if row.kind is bool else f"{row.flag} {NOTED_VALUES[row.flag]}"
        assert [line for line in lines if line.startswith(shown + ":")] == [
            f"{shown}: {row.why}"], row.flag
    for row in _rows(megatron_lm.ACCEPTED):
        assert not [line for line in lines if line.startswith(row.flag)], row.flag


def test_accepted_flags_say_what_the_built_run_does(measured):
    """The fusions the ACCEPTED rows name are off in the trainer's TransformerConfig of a
    local-implementation run (RoPE fusion is Transformer Engine's: on only where TE builds the
    layers, tests/model/test_fusions.py), and the dataset builder got
    --num-dataset-builder-threads."""
    config = measured.trainer.model[0].config
    assert not (config.bias_activation_fusion or config.bias_dropout_fusion
                or config.apply_rope_fusion or config.persist_layer_norm
                or config.masked_softmax_fusion)
    assert measured.trainer.train_ds.config.num_dataset_builder_threads == 2


# ---- --no-X over a --config file ----------------------------------------------------------

def test_negations_give_the_plain_fp32_run(negated):
    trainer, cfg = negated.trainer, negated.trainer.cfg
    for section, name in NEGATIONS.values():
        assert getattr(getattr(cfg, section), name) is False, name
    for section, name in RESTORED.values():
        assert getattr(getattr(cfg, section), name) is True, name
    # --no-bf16/--no-fp16: fp32 parameters, no Float16Module, fp32 optimizers
    params = [p for chunk in trainer.model for p in chunk.parameters()]
    assert params and all(p.dtype == torch.float32 for p in params)
    assert type(trainer.model[0].module).__name__ == "GPTModel"
    names = {type(opt).__name__ for opt in optimizers(trainer)}
    assert names == {"FP32Optimizer"}  # --no-use-distributed-optimizer too
    # --no-sequence-parallel: not even the line saying TP 1 turned it off
    assert "--sequence-parallel" not in negated.log
    # --no-calculate-per-token-loss, --no-sft: the mean of micro-batch means, pretraining data
    assert cfg.per_token_loss() is False and type(trainer.train_ds).__name__ == "GPTDataset"
    # --no-override/--no-use-checkpoint-opt-param-scheduler: a resume must match the flags
    assert cfg.optim.scheduler_mode() == "strict"


# ---- fp16 and recompute ------------------------------------------------------------------

def test_initial_loss_scale_and_fp32_grad_reduction_under_fp16(demo_data):
    argv = base_args(demo_data, **SHAPES, fp16=True, initial_loss_scale=1024,
                     accumulate_allreduce_grads_in_fp32=True, recompute_granularity="selective",
                     recompute_modules="mlp", no_exit_signal_handler=True)
    with set_up(argv) as built:
        trainer = built.trainer
        [opt] = optimizers(trainer)
        assert type(opt).__name__ == "Float16OptimizerWithFloat16Params"
        assert float(opt.grad_scaler.scale) == 1024.0
        assert float(trainer.optimizer.get_loss_scale()) == 1024.0
        # the scale the step multiplies the loss (and JREG's injected gradient) by
        config = trainer.model[0].config
        assert float(config.grad_scale_func(torch.ones(1))) == 1024.0
        # --accumulate-allreduce-grads-in-fp32: fp16 parameters, fp32 gradient buffers
        assert trainer.model[0].ddp_config.grad_reduce_in_fp32 is True
        params = list(trainer.model[0].parameters())
        assert all(p.dtype == torch.float16 and p.main_grad.dtype == torch.float32 for p in params)
        # --recompute-modules mlp: each layer replays its MLP, nothing else
        assert config.recompute_modules == ["mlp"]
        for layer in trainer.model[0].module.module.decoder.layers:
            assert layer.recompute_mlp and not layer.recompute_input_layernorm
            assert not layer.recompute_pre_mlp_layernorm


# ---- mixture of experts ----------------------------------------------------------------------

def _routed(router, hidden):
    """The router's probs and routing map of 10 random hidden states (in evaluation: no
    load-balancing loss is attached), and those states as [tokens, hidden]."""
    x = torch.randn(5, 2, hidden, generator=torch.Generator().manual_seed(0))
    router.eval()
    try:
        with torch.no_grad():
            probs, routing_map = router(x)
    finally:
        router.train()
    return probs, routing_map, x.reshape(-1, hidden)


def test_moe_flags_reach_the_router_and_the_experts(demo_data):
    argv = base_args(demo_data, **SHAPES, num_experts=4, moe_router_topk=3,
                     moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.02,
                     moe_ffn_hidden_size=48, moe_grouped_gemm=True, moe_router_pre_softmax=True,
                     no_exit_signal_handler=True)
    with set_up(argv) as built:
        hidden = built.trainer.cfg.model.hidden_size
        layers = built.trainer.model[0].module.decoder.layers
        # --moe-router-pre-softmax (Megatron-LM's routing): the softmax over all 4 experts'
        # logits, of which the top 3 keep their probabilities; without it the 3 chosen
        # logits are softmaxed among themselves (each token's weights summing to 1)
        probs, routing_map, x = _routed(layers[0].mlp.router, hidden)
        p = torch.softmax(x @ layers[0].mlp.router.weight.T, dim=-1)
        top = p.topk(3, dim=-1)
        expected = torch.zeros_like(p).scatter(1, top.indices, top.values)
        assert torch.equal(routing_map, expected > 0)
        torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-7)
        assert (probs.sum(dim=-1) < 0.99).all()
        # Mixtral's router renormalizes over the chosen experts: no family to export to
        assert built.trainer.cfg.model.family == "other"
        assert len(layers) == built.trainer.cfg.model.num_layers
        for layer in layers:
            mlp = layer.mlp
            assert type(mlp.router).__name__ == "TopKRouter" and mlp.router.topk == 3
            assert mlp.router.routing_type == "seq_aux_loss"
            assert mlp.router.get_aux_loss_coeff("seq_aux_loss") == 0.02
            assert mlp.router.get_aux_loss_coeff("aux_loss") == 0.0
            assert type(mlp.token_dispatcher).__name__ == "MoEAllGatherTokenDispatcher"
            # --moe-grouped-gemm without Transformer Engine: the experts one by one
            assert type(mlp.experts).__name__ == "SequentialMLP"
            experts = mlp.experts.local_experts
            assert len(experts) == 4
            for expert in experts:  # SwiGLU: gate and up rows of --moe-ffn-hidden-size each
                assert tuple(expert.linear_fc1.weight.shape) == (2 * 48, hidden)
                assert tuple(expert.linear_fc2.weight.shape) == (hidden, 48)
        assert built.log.count("--moe-grouped-gemm: the local implementation runs the experts") == 1
