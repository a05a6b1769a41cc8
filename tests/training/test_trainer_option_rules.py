"""Trainer flags whose effect is a rule the trainer applies before or beside the model: the
refused Megatron-LM flags, the WSD learning-rate schedule against megatron-core's
definition written out here, how a resumed schedule is reconciled under each spelling of
the scheduler flags, --ckpt-format, the timeout the process group is started with, the
pre-work checks a --no-X negation turns back on, the mixture-of-experts router settings
megatron-core refuses (refused here before any work), and the fp16 loss scale's default.
(The MoE token dispatchers against each other: test_moe_dispatchers.py.)"""

import copy
import itertools
import math
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from set_up_trainer import NEGATIONS, RESTORED
from trainer_runs import base_args

from megatron_jreg import train
from megatron_jreg.checkpoint.dist_checkpoint import TRACKER, CheckpointError
from megatron_jreg.checkpoint.scheduler_state import load_scheduler
from megatron_jreg.commands import flags as cli
from megatron_jreg.commands.train import from_argv
from megatron_jreg.config import megatron_lm
from megatron_jreg.config.run import SECTIONS
from megatron_jreg.distributed import setup
from megatron_jreg.model.builder import transformer_config
from megatron_jreg.training.optimizer import build_scheduler


def experiment(argv):
    return from_argv(["--data-path", "x"] + [str(a) for a in argv])


def refused(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        experiment(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    return err


# ---- refused Megatron-LM flags -------------------------------------------------------------
# flag -> (value given, the value as the message shows it); the switches are given bare
REFUSED_VALUES = {"--rotary-seq-len-interpolation-factor": ("4", "4"),
                  "--fp8-format": ("hybrid", "hybrid"), "--optimizer": ("muon", "muon"),
                  "--decoupled-lr": ("1e-4", "0.0001"), "--decoupled-min-lr": ("1e-5", "1e-05"),
                  "--weight-decay-incr-style": ("cosine", "cosine"),
                  "--loss-scale": ("1024", "1024.0")}
REFUSED = [row for row in megatron_lm.TABLE if row.status == megatron_lm.REFUSED]


@pytest.mark.parametrize("row", REFUSED, ids=[row.flag for row in REFUSED])
def test_refused_flag_stops_the_run_naming_it(row, capsys):
    if row.kind is bool:
        argv, shown = [row.flag], row.flag
    else:
        value, as_shown = REFUSED_VALUES[row.flag]
        argv, shown = [row.flag, value], f"{row.flag} {as_shown}"
    assert f"error: {shown}: not supported: " in refused(argv, capsys)


def test_refused_flags_accept_the_value_that_is_what_happens_here():
    assert {r.flag for r in REFUSED if r.kind is not bool} == set(REFUSED_VALUES)
    c = experiment(["--optimizer", "adam", "--weight-decay-incr-style", "constant"])
    assert (c.megatron_lm.optimizer, c.megatron_lm.weight_decay_incr_style) == ("adam", "constant")


# ---- the WSD schedule ------------------------------------------------------------------------
ITERS, G, PEAK, FLOOR, WARMUP = 100, 8, 1e-3, 1e-4, 10


def wsd_lrs(argv):
    """The lr of the scheduler the trainer builds from ``argv``, after 0..ITERS steps (each
    step counts a global batch of samples, as Trainer.train_step does)."""
    c = experiment(["--train-iters", ITERS, "--global-batch-size", G, "--micro-batch-size", G,
                    "--lr", PEAK, "--min-lr", FLOOR, "--lr-warmup-iters", WARMUP,
                    "--lr-decay-style", "WSD"] + argv)
    optimizer = SimpleNamespace(param_groups=[{}, {}])
    scheduler = build_scheduler(optimizer, c.optim, c.training)
    out = [optimizer.param_groups[0]["lr"]]
    for _ in range(ITERS):
        scheduler.step(increment=G)
        assert optimizer.param_groups[1]["lr"] == optimizer.param_groups[0]["lr"]
        out.append(optimizer.param_groups[0]["lr"])
    return out


def wsd_expected(samples, style, final_samples):
    """megatron-core's WSD (OptimizerParamScheduler): linear warmup, then the peak until
    the last ``final_samples`` of the decay, then the peak decays to the floor in that
    style; r is the share of the final decay done."""
    if samples <= WARMUP * G:
        return PEAK * samples / (WARMUP * G)
    start = ITERS * G - final_samples
    if samples <= start:
        return PEAK
    r = (samples - start) / final_samples
    coeff = {"linear": 1 - r, "cosine": 0.5 * (1 + math.cos(math.pi * r)),
             "exponential": 2 * 0.5 ** r - 1, "minus_sqrt": 1 - math.sqrt(r)}[style]
    return FLOOR + coeff * (PEAK - FLOOR)


@pytest.mark.parametrize("style", ["linear", "cosine", "exponential", "minus_sqrt"])
def test_wsd_decay_style_and_length(style):
    got = wsd_lrs(["--lr-wsd-decay-style", style, "--lr-wsd-decay-iters", 20])
    want = [wsd_expected(k * G, style, 20 * G) for k in range(ITERS + 1)]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert got[80] == PEAK and got[ITERS] == pytest.approx(FLOOR)


def test_wsd_decay_in_samples_and_its_default():
    """--lr-wsd-decay-samples 100 (not whole steps): the final decay starts 100 samples
    before the end; without either flag it is 10% of the decay (10 steps here)."""
    got = wsd_lrs(["--lr-wsd-decay-style", "cosine", "--lr-wsd-decay-samples", 100])
    assert got == pytest.approx([wsd_expected(k * G, "cosine", 100) for k in range(ITERS + 1)],
                                rel=1e-9, abs=1e-15)
    assert got[87] == PEAK and got[88] < PEAK
    got = wsd_lrs([])  # --lr-wsd-decay-style's default: exponential, as in Megatron-LM
    assert got == pytest.approx([wsd_expected(k * G, "exponential", 10 * G)
                                 for k in range(ITERS + 1)],
                                rel=1e-9, abs=1e-15)


# ---- a resumed schedule under each spelling of the scheduler flags --------------------------
@pytest.mark.parametrize("in_file, argv, mode", [
    (None, ["--override-opt_param-scheduler"], "override"),
    (None, ["--use-checkpoint-opt_param-scheduler"], "checkpoint"),
    ("override_opt_param_scheduler", [], "override"),
    ("override_opt_param_scheduler", ["--no-override-opt_param-scheduler"], "strict"),
    ("override_opt_param_scheduler", ["--no-override-opt-param-scheduler"], "strict"),
    ("use_checkpoint_opt_param_scheduler", ["--no-use-checkpoint-opt_param-scheduler"], "strict"),
    ("use_checkpoint_opt_param_scheduler", ["--no-use-checkpoint-opt-param-scheduler"], "strict"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_scheduler_flags_decide_a_resumed_schedule(in_file, argv, mode, tmp_path):
    """A checkpoint's schedule with peak lr 2e-3 loaded into a run with --lr 1e-3, the way
    the Checkpointer does (scheduler_state.load_scheduler with the flags' mode): override
    keeps the flags, checkpoint takes the saved one, neither (strict) refuses the mismatch."""
    def scheduler(extra):
        c = experiment(["--train-iters", 100, "--global-batch-size", 8,
                        "--micro-batch-size", 8] + extra)
        return c, build_scheduler(SimpleNamespace(param_groups=[{}]), c.optim, c.training)

    _, saved = scheduler(["--lr", "2e-3"])
    saved.step(increment=80)
    if in_file:
        config = tmp_path / "run.yaml"
        config.write_text(f"{in_file}: true\n")
        argv = ["--config", config] + argv
    c, resumed = scheduler(["--lr", "1e-3"] + argv)
    assert c.optim.scheduler_mode() == mode
    if mode == "strict":
        with pytest.raises(CheckpointError, match="schedule differs from the checkpoint's"):
            load_scheduler(resumed, saved.state_dict(), c.optim.scheduler_mode(), 8)
        return
    load_scheduler(resumed, saved.state_dict(), c.optim.scheduler_mode(), 8)
    assert resumed.max_lr == {"override": 1e-3, "checkpoint": 2e-3}[mode]
    assert resumed.num_steps == 80


def test_a_schedule_of_the_former_defaults_is_named_in_one_line():
    """A checkpoint saved with the schedule this trainer once took by default (cosine decay,
    weight decay 0.1), resumed with no schedule flag (now Megatron-LM's linear and 0.01):
    one line names the flags that continue it; with them, or with
    --use-checkpoint-opt-param-scheduler, it loads."""
    def scheduler(extra):
        c = experiment(["--train-iters", 100, "--global-batch-size", 8, "--micro-batch-size", 8,
                        "--lr-warmup-iters", 10] + extra)
        return c, build_scheduler(SimpleNamespace(param_groups=[{}]), c.optim, c.training)

    _, saved = scheduler(["--lr-decay-style", "cosine", "--weight-decay", "0.1"])
    saved.step(increment=8 * 40)
    c, resumed = scheduler([])
    with pytest.raises(CheckpointError) as err:
        load_scheduler(resumed, saved.state_dict(), c.optim.scheduler_mode(), 8)
    assert str(err.value) == (
        "the learning-rate schedule differs from the checkpoint's (--lr-decay-style linear "
        "here, --lr-decay-style cosine in the checkpoint; --weight-decay 0.01 here, "
        "--weight-decay 0.1 in the checkpoint): to continue it pass --lr-decay-style cosine "
        "--weight-decay 0.1 or --use-checkpoint-opt-param-scheduler; "
        "--override-opt-param-scheduler takes this run's values instead")
    for fix in (["--lr-decay-style", "cosine", "--weight-decay", "0.1"],
                ["--use-checkpoint-opt-param-scheduler"]):
        c, resumed = scheduler(fix)
        load_scheduler(resumed, saved.state_dict(), c.optim.scheduler_mode(), 8)
        assert (resumed.lr_decay_style, resumed.start_wd, resumed.num_steps) == ("cosine", 0.1, 320)


def test_a_changed_length_is_named_in_steps_or_samples():
    """A decay length the run's global batch divides is named as --lr-decay-iters, another
    as --lr-decay-samples (no flag takes a fraction of a step)."""
    def scheduler(extra):
        c = experiment(["--train-iters", 100, "--global-batch-size", 8, "--micro-batch-size", 8]
                       + extra)
        return c, build_scheduler(SimpleNamespace(param_groups=[{}]), c.optim, c.training)

    c, resumed = scheduler([])
    for saved_flag, named in ((["--lr-decay-iters", 60], "--lr-decay-iters 60"),
                              (["--lr-decay-samples", 500], "--lr-decay-samples 500")):
        _, saved = scheduler(saved_flag)
        with pytest.raises(CheckpointError, match=f"to continue it pass {named} or"):
            load_scheduler(resumed, saved.state_dict(), c.optim.scheduler_mode(), 8)


# ---- --ckpt-format ------------------------------------------------------------------------------
def test_ckpt_format_takes_torch_dist_only(capsys):
    # (what a torch_dist save puts on disk: test_wandb_sink.py)
    assert experiment(["--ckpt-format", "torch_dist"]).checkpoint.ckpt_format == "torch_dist"
    err = refused(["--ckpt-format", "torch"], capsys)
    assert "error: --ckpt-format 'torch': only torch_dist is supported" in err


# ---- the process group ------------------------------------------------------------------------
def test_initialize_distributed_hands_its_timeout_to_the_process_group(monkeypatch):
    """(The trainer passes --distributed-timeout-minutes to it: test_trainer_options.py.)
    A world of one and a launched rank alike start their group with that timeout."""
    started = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: started.append(kwargs))
    monkeypatch.delenv("RANK", raising=False)
    setup.initialize_distributed(timeout_minutes=7)
    monkeypatch.setenv("RANK", "0")
    setup.initialize_distributed(timeout_minutes=7)
    assert [kwargs["timeout"] for kwargs in started] == [timedelta(minutes=7)] * 2


# ---- --no-X over a --config file -------------------------------------------------------------
def test_every_negation_of_the_parser_is_listed():
    actions = cli.build_parser(SECTIONS)._actions
    negations = {flag for a in actions for flag in a.option_strings
                 if flag.startswith("--no-") and type(a).__name__ == "BooleanOptionalAction"}
    listed = set(NEGATIONS) | {"--no-" + flag[2:] for flag in RESTORED}
    # Megatron-LM's other spelling of the scheduler flags has its negation too (above)
    assert negations == listed | {"--no-override-opt_param-scheduler",
                                  "--no-use-checkpoint-opt_param-scheduler"}


@pytest.mark.parametrize("flag", list(NEGATIONS) + list(RESTORED))
def test_negation_undoes_the_config_file(flag, tmp_path):
    """The file's setting as given (what the trainer's notes read), then the flag's."""
    section, name = {**NEGATIONS, **RESTORED}[flag]
    default = flag in RESTORED
    config = tmp_path / "run.yaml"
    config.write_text(f"{section}: {{{name}: {str(not default).lower()}}}\n")
    assert experiment(["--config", config]).given[section][name] is (not default)
    c = experiment(["--config", config, flag])
    assert c.given[section][name] is default and getattr(getattr(c, section), name) is default


@pytest.mark.parametrize("in_file, flag, message", [
    ("overwrite_checkpoints", "--no-overwrite-checkpoints", "already holds checkpoints"),
    ("finetune", "--no-finetune", "--finetune loads weights from --pretrained-checkpoint"),
    ("sft", "--no-sft", "_loss_mask.bin does not exist"),
], ids=["overwrite", "finetune", "sft"])
def test_negation_restores_the_pre_work_checks(in_file, flag, message, demo_data, tmp_path):
    """--overwrite-checkpoints in the file lets a run write into a --save that holds
    checkpoints, and the negation refuses it again; --finetune (no checkpoint to load) and
    --sft (on pretraining data) in the file are refused, and pass once negated."""
    config = tmp_path / "run.yaml"
    config.write_text(f"{in_file}: true\n")
    argv = base_args(demo_data, config=config)
    if in_file == "overwrite_checkpoints":
        save = tmp_path / "ckpt"
        save.mkdir()
        (save / TRACKER).write_text("3")
        argv += ["--save", str(save)]
        accepted, refused_argv = argv, argv + [flag]
    else:
        accepted, refused_argv = argv + [flag], argv
    _pre_work_checks(from_argv(accepted))
    with pytest.raises(ValueError, match=message):
        _pre_work_checks(from_argv(refused_argv))


def _pre_work_checks(experiment):
    """The settings' checks, then --save's lineage as the run judges it under its lock."""
    from megatron_jreg.checkpoint import catalog

    experiment.validate(world_size=1)
    if experiment.checkpoint.save:
        experiment.check_save_lineage(catalog.scan(experiment.checkpoint.save))


# ---- mixture-of-experts routing --------------------------------------------------------------
MIXTRAL = ["--model-preset", "mixtral-tiny"]  # 8 experts, top 2, --moe-aux-loss-coeff 0.01


def main_refuses(argv, capsys) -> str:
    """``megatron_jreg.train.main`` on ``argv``: exit status 2 and one line, before any work
    (the parse ends the run; --data-path x does not exist)."""
    with pytest.raises(SystemExit) as exc:
        train.main(["--data-path", "x"] + [str(a) for a in argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage" not in err, err
    return err


def megatron_config(model, parallel, **settings):
    """megatron-core's TransformerConfig of ``model`` with ``settings`` changed (past the
    trainer's own checks): its __post_init__ applies megatron-core's rules."""
    model = copy.copy(model)
    for name, value in settings.items():
        setattr(model, name, value)
    return transformer_config(model, parallel)


@pytest.mark.parametrize("topk, pre_softmax, balancing",
                         itertools.product((1, 2), (False, True), ("aux_loss", "sinkhorn")))
def test_router_settings_refused_exactly_where_megatron_core_refuses_them(
        topk, pre_softmax, balancing, capsys):
    """megatron-core's TransformerConfig is the reference: it raises for top-1 routing
    without --moe-router-pre-softmax (a softmax over one expert has no gradient) unless the
    routing is sinkhorn. The trainer refuses the same settings in one line before any work,
    and hands the others to megatron-core as given."""
    base = experiment(MIXTRAL + ["--moe-aux-loss-coeff", "0"])
    base.model.vocab_size = 256
    settings = dict(moe_router_topk=topk, moe_router_pre_softmax=pre_softmax,
                    moe_router_load_balancing_type=balancing)
    try:
        megatron_config(base.model, base.parallel, **settings)
        megatron_refuses = False
    except ValueError as err:
        assert "--moe-router-pre-softmax" in str(err)
        megatron_refuses = True
    argv = MIXTRAL + ["--moe-aux-loss-coeff", 0, "--moe-router-topk", topk,
                      "--moe-router-load-balancing-type", balancing]
    argv += ["--moe-router-pre-softmax"] if pre_softmax else []
    if megatron_refuses:
        err = main_refuses(argv, capsys)
        assert "error: --moe-router-topk 1 needs --moe-router-pre-softmax" in err, err
        return
    c = experiment(argv)
    c.model.vocab_size = 256
    config = transformer_config(c.model, c.parallel)
    assert {name: getattr(config, name) for name in settings} == settings


def sinkhorn_routing(config):
    """megatron-core's sinkhorn routing in training (TopKRouter.sinkhorn_load_balancing)
    under ``config``, of 16 tokens' random logits: (probs, routing map)."""
    from megatron.core.transformer.moe.router import TopKRouter

    router = SimpleNamespace(config=config, topk=config.moe_router_topk, training=True)
    logits = torch.randn(16, config.num_moe_experts, generator=torch.Generator().manual_seed(0))
    return TopKRouter.sinkhorn_load_balancing(router, logits)


def test_sinkhorn_takes_no_load_balancing_loss(capsys):
    """megatron-core's sinkhorn routing asserts at the first forward when the
    load-balancing coefficient is above 0; the trainer refuses that before any work, naming
    both flags, the coefficient's origin when a preset set it, and the fix, which runs."""
    c = experiment(MIXTRAL + ["--moe-router-load-balancing-type", "sinkhorn",
                              "--moe-aux-loss-coeff", 0])
    c.model.vocab_size = 256
    config = transformer_config(c.model, c.parallel)
    _, routing_map = sinkhorn_routing(config)
    assert routing_map.sum(dim=1).tolist() == [2] * 16  # the fix routes, two experts a token
    config.moe_aux_loss_coeff = 0.01  # the preset's coefficient, past the trainer's check
    with pytest.raises(AssertionError, match="Sinkhorn routing does not support aux loss"):
        sinkhorn_routing(config)
    err = main_refuses(MIXTRAL + ["--moe-router-load-balancing-type", "sinkhorn"], capsys)
    assert err.split("error: ", 1)[1] == (
        "--moe-router-load-balancing-type sinkhorn takes no load-balancing loss, but "
        "--moe-aux-loss-coeff is 0.01 (--model-preset mixtral-tiny sets it); pass "
        "--moe-aux-loss-coeff 0\n")
    err = main_refuses(["--model-preset", "tiny", "--num-experts", 4, "--moe-aux-loss-coeff",
                        "0.02", "--moe-router-load-balancing-type", "sinkhorn"], capsys)
    assert err.endswith("but --moe-aux-loss-coeff is 0.02; pass --moe-aux-loss-coeff 0\n"), err


# ---- the fp16 loss scale ----------------------------------------------------------------------
def test_initial_loss_scale_defaults_to_megatrons():
    """Without --initial-loss-scale an fp16 run starts at megatron-core's OptimizerConfig
    default, which is Megatron-LM's (2^32); the optimizer takes the setting as it is
    (test_trainer_options.py builds one at 1024)."""
    from megatron.core.optimizer import OptimizerConfig

    default = OptimizerConfig.__dataclass_fields__["initial_loss_scale"].default
    assert experiment(["--fp16"]).optim.initial_loss_scale == default == 2.0 ** 32
