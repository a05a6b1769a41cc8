"""The trainer under context parallelism equals one rank: the LM loss, every Psi_l, zeta,
the penalty and the gradient norm of each step, on the demo data at seq 256 in fp32; a
checkpoint saved at one CP size resumes at another exactly; the flags a run cannot use are
refused in one line before any work.

The model-level layouts (CP2 with TP2 and SP, PP2, interleaved PP, DP2, full recompute) are
in tests/model/test_parallel_layouts.py; the attention alone in tests/model/test_cp_attention.py.
"""

import pytest
from trainer_runs import base_args, read_metrics, train

from megatron_jreg.commands.train import from_argv

SEQ = 256


def _args(data, **overrides):
    return base_args(data, seq_length=SEQ, micro_batch_size=2, global_batch_size=4,
                     **overrides)


def assert_same_steps(got, ref):
    assert [r["iteration"] for r in got] == [r["iteration"] for r in ref]
    for a, b in zip(ref, got):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["jreg_penalty"] == pytest.approx(a["jreg_penalty"], rel=1e-4)
        assert b["psi"] == pytest.approx(a["psi"], rel=1e-4, abs=1e-7)
        for zeta in ("zeta_L", "zeta_L-1", "zeta_L-2"):
            assert b[zeta] == pytest.approx(a[zeta], rel=1e-3, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


# --eod-mask-loss drops the targets after each document's end: the loss mask then differs
# between the chunks each CP rank holds, and the loss is still the one rank's mean
VARIANTS = {
    "plain": {},
    "eod_mask_distopt_eval": {"eod_mask_loss": True, "use_distributed_optimizer": True,
                              "eval_interval": 3, "eval_iters": 1},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cp2_equals_one_rank(demo_data, tmp_path, variant):
    flags = VARIANTS[variant]
    ref, got = tmp_path / "one.jsonl", tmp_path / "cp2.jsonl"
    train(_args(demo_data, train_iters=3, metrics_file=ref, **flags))
    proc = train(_args(demo_data, train_iters=3, metrics_file=got, context_parallel_size=2,
                       **flags), nproc=2)
    assert "(TP 1, PP 1, CP 2, DP 1)" in proc.stdout
    ref_rows, got_rows = read_metrics(ref), read_metrics(got)
    assert len(ref_rows) == 3
    assert_same_steps(got_rows, ref_rows)
    assert ref_rows[-1]["lm_loss"] < ref_rows[0]["lm_loss"]  # it trained
    if flags.get("eval_interval"):
        lines = [l for l in proc.stdout.splitlines() if "validation" in l]
        assert lines, proc.stdout[-2000:]


@pytest.fixture(scope="module")
def uninterrupted(demo_data, tmp_path_factory):
    metrics = tmp_path_factory.mktemp("cp_resume") / "ref.jsonl"
    train(_args(demo_data, train_iters=4, metrics_file=metrics, use_distributed_optimizer=True))
    return read_metrics(metrics)


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)], ids=["cp2_to_cp1", "cp1_to_cp2"])
def test_resume_across_cp_sizes_is_exact(demo_data, uninterrupted, tmp_path, first, then):
    """Saved after step 2 at one CP size (the distributed optimizer's state sharded over
    the DP x CP ranks there), resumed at the other: steps 3-4 equal the uninterrupted run."""
    save, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = dict(train_iters=4, save=save, metrics_file=metrics, use_distributed_optimizer=True)
    train(_args(demo_data, exit_interval=2, context_parallel_size=first, **common), nproc=first)
    proc = train(_args(demo_data, load=save, context_parallel_size=then, **common), nproc=then)
    assert "loaded checkpoint" in proc.stdout + proc.stderr
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert_same_steps(rows, uninterrupted)


@pytest.mark.parametrize("flags,message", [
    (["--context-parallel-size", "2", "--seq-length", "250"],
     "--seq-length 250 must be a multiple of 2 x --context-parallel-size = 4 (each CP rank "
     "holds 2 of 4 equal chunks of every sequence); change one of them"),
    (["--context-parallel-size", "4", "--seq-length", "36"],
     "--seq-length 36 must be a multiple of 2 x --context-parallel-size = 8"),
])
def test_uneven_sequence_is_refused_with_the_flags(flags, message, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit) as exc:
        from_argv(["--data-path", "x", "--model-preset", "tiny"] + flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flags,message", [
    (["--context-parallel-size", "0"], "--context-parallel-size must be >= 1, got 0"),
    (["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "-1", "-2"],
     "--hierarchical-context-parallel-sizes must be >= 1, got -1"),
])
def test_bad_context_parallel_values_are_refused_in_one_line(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        from_argv(["--data-path", "x", "--model-preset", "tiny"] + flags)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_an_empty_cp_comm_type_in_a_config_file_is_refused(tmp_path, capsys):
    """The command line needs a value after --cp-comm-type; a YAML list may be empty."""
    config = tmp_path / "run.yaml"
    config.write_text("context_parallel_size: 2\ncp_comm_type: []\n")
    with pytest.raises(SystemExit) as exc:
        from_argv(["--config", str(config), "--data-path", "x", "--model-preset", "tiny"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "--cp-comm-type: no kind given" in err, err


@pytest.mark.parametrize("extra,message", [
    (["--cp-comm-type", "p2p"], "--cp-comm-type p2p needs Transformer Engine's attention"),
    (["--cp-comm-type", "all_gather", "a2a", "all_gather", "all_gather"],
     "--cp-comm-type a2a needs Transformer Engine's attention"),
    (["--cp-comm-type", "all_gather", "all_gather"],
     "--cp-comm-type: 2 values for 4 layers; give one, or one per layer"),
    (["--attention-backend", "local"],
     "--attention-backend local: megatron-core's local attention has no context parallelism"),
    # each CP rank's 6 tokens split over 4 TP ranks
    (["--sequence-parallel", "--tensor-model-parallel-size", "4", "--num-query-groups", "4",
      "--seq-length", "12"],
     "--seq-length 12 must be divisible by TP 4 under --sequence-parallel x CP 2"),
])
def test_what_the_attention_cannot_do_is_refused_before_work(demo_data, extra, message,
                                                             monkeypatch):
    """Without Transformer Engine (CPU): the SDPA attention all-gathers; megatron-core's
    local attention has no CP at all."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    run = from_argv(["--data-path", demo_data, "--model-preset", "tiny", "--tokenizer-type",
                     "ByteTokenizer", "--train-iters", "1", "--lr", "1e-3",
                     "--context-parallel-size", "2", "--transformer-impl", "local"] + extra)
    with pytest.raises(ValueError) as exc:
        run.validate(tokenizer_vocab_size=259)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_all_gather_is_what_the_sdpa_attention_runs(demo_data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for kind in ("all_gather", "allgather"):
        run = from_argv(["--data-path", demo_data, "--model-preset", "tiny", "--tokenizer-type",
                         "ByteTokenizer", "--train-iters", "1", "--lr", "1e-3",
                         "--context-parallel-size", "2", "--transformer-impl", "local",
                         "--cp-comm-type", kind])
        run.validate(tokenizer_vocab_size=259)
        assert run.parallel.cp_comm_type == ["all_gather"]
        assert run.parallel.cp_comm_types(run.model.num_layers, False) == "all_gather"
    # with Transformer Engine's attention the kinds are megatron-core's, p2p left out
    assert run.parallel.cp_comm_types(4, True) == "all_gather"
    assert from_argv(["--data-path", demo_data, "--context-parallel-size", "2"]
                     ).parallel.cp_comm_types(4, True) == "p2p"


@pytest.mark.parametrize("extra,message", [
    (["--cp-comm-type", "a2a", "--context-parallel-size", "4"],
     "--cp-comm-type a2a splits each TP rank's 4 attention heads and 2 query groups over 4 CP "
     "ranks, which must divide both"),
    (["--cp-comm-type", "a2a+p2p", "--context-parallel-size", "4",
      "--hierarchical-context-parallel-sizes", "4", "1"],
     "--cp-comm-type a2a+p2p splits each TP rank's 4 attention heads and 2 query groups over 4"),
    # megatron-core 0.16.1 reads a per-layer list one layer off: mixed kinds are refused,
    # one kind given per layer is that kind
    (["--cp-comm-type", "p2p", "a2a", "p2p", "p2p", "--context-parallel-size", "2"],
     "--cp-comm-type p2p a2a p2p p2p: layers of different kinds are not supported"),
    (["--cp-comm-type", "a2a", "a2a", "a2a", "a2a", "--context-parallel-size", "2"], None),
    (["--cp-comm-type", "a2a", "--context-parallel-size", "2"], None),
    (["--cp-comm-type", "a2a+p2p", "--context-parallel-size", "4",
      "--hierarchical-context-parallel-sizes", "2", "2"], None),
])
def test_transformer_engine_all_to_all_needs_heads_per_cp_rank(demo_data, extra, message,
                                                               monkeypatch):
    """Transformer Engine's arm of the check, taken on CPU: its all-to-all kinds exchange
    heads for sequence, so the heads and query groups split over the exchanging ranks."""
    from megatron_jreg.config import model as model_config

    monkeypatch.setattr(model_config, "transformer_engine_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "4")
    run = from_argv(["--data-path", demo_data, "--model-preset", "tiny", "--tokenizer-type",
                     "ByteTokenizer", "--train-iters", "1", "--lr", "1e-3",
                     "--transformer-impl", "transformer_engine"] + extra)
    if message is None:
        run.validate(tokenizer_vocab_size=259)
        return
    with pytest.raises(ValueError) as exc:
        run.validate(tokenizer_vocab_size=259)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_one_kind_per_layer_trains(demo_data, tmp_path):
    """A --cp-comm-type list of one kind per layer is that kind (megatron-core 0.16.1 read
    the list one layer off and failed at the last layer's index)."""
    metrics = tmp_path / "m.jsonl"
    train(base_args(demo_data, train_iters=1, metrics_file=metrics, context_parallel_size=2)
          + ["--cp-comm-type"] + ["all_gather"] * 4, nproc=2)
    assert len(read_metrics(metrics)) == 1
