"""Megatron-LM command lines run with only the entry point changed: architecture flags build
the model (presets are bundles of the same flags), schedule and data flags mean what they
mean in Megatron-LM, implementation flags are honoured or noted in one line, and what
changes the math without support is refused by name. No flag may be abbreviated."""

import ast
import dataclasses
import os
from types import SimpleNamespace

import pytest
from trainer_runs import REPO, base_args, read_metrics, run_env, train

from megatron_jreg.commands import flags as cli
from megatron_jreg.commands.train import from_argv
from megatron_jreg.config.model import PRESETS, preset_flags
from megatron_jreg.config.run import BUILDERS, SECTIONS, OptimConfig
from megatron_jreg.training.experiment import ExperimentConfig
from megatron_jreg.training.optimizer import build_scheduler

# Megatron-LM's Llama-2 pretraining flags, written the way its examples write them, at the
# tiny preset's sizes (examples/llama, docs/llama2.md of Megatron-LM)
LLAMA2_MODEL = """
    --use-mcore-models --num-layers 4 --hidden-size 64 --ffn-hidden-size 192
    --num-attention-heads 4 --group-query-attention --num-query-groups 2
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope
    --rotary-base 10000 --rotary-percent 1.0 --swiglu --normalization RMSNorm
    --norm-epsilon 1e-5 --untie-embeddings-and-output-weights --disable-bias-linear
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.02
    --attention-softmax-in-fp32 --no-masked-softmax-fusion --no-bias-swiglu-fusion
    --make-vocab-size-divisible-by 128 --transformer-impl local"""
LLAMA2_RUN = """
    --micro-batch-size 4 --global-batch-size 8 --train-samples 16 --lr 3e-3 --min-lr 3e-4
    --lr-warmup-fraction 0.01 --lr-decay-style cosine --weight-decay 0.1 --adam-beta1 0.9
    --adam-beta2 0.95 --clip-grad 1.0 --seed 1234 --tokenizer-type ByteTokenizer --split 949,50,1
    --use-flash-attn --attention-backend auto --overlap-grad-reduce --log-throughput
    --timing-log-level 0 --dataloader-type cyclic --num-workers 2 --log-interval 1
    --eval-interval 1000 --eval-iters 1 --distributed-backend gloo --no-gradient-accumulation-fusion
    --jreg-lambda 1.0"""


def steps(path):
    """What a run computed at each logged step (not its speed or memory)."""
    keys = ("iteration", "lm_loss", "jreg_penalty", "psi", "lr", "grad_norm")
    return [tuple(str(r[k]) for k in keys) for r in read_metrics(path)]


def parse(argv, given=None):
    return cli.parse(SECTIONS, argv, build=BUILDERS, given=given)


def refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "usage" not in err, err
    return err


# ---- no abbreviations ----------------------------------------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["--jreg-l", "0.5"], "--jreg-l 0.5"),  # would have been --jreg-lambda 0.5
    (["--exit-signal-h"], "--exit-signal-h"),  # would have been --exit-signal-handler
    (["--seq", "64"], "--seq 64"),
])
def test_abbreviated_flags_are_refused_in_one_line(argv, named, capsys):
    err = refused(["--data-path", "x"] + argv, capsys)
    assert f"unrecognized arguments: {named}" in err


def test_exit_signal_is_megatron_lms_flag_not_an_abbreviation():
    c = parse(["--data-path", "x", "--exit-signal", "SIGTERM"])
    assert c["training"].exit_signal == "SIGTERM" and c["training"].exit_signal_handler is True
    assert parse(["--data-path", "x", "--exit-signal",
                  "SIGUSR1"])["training"].exit_signal == "SIGUSR1"


def test_every_parser_refuses_abbreviations():
    """Every entry point builds its parser with cli.ArgumentParser (allow_abbrev=False)."""
    assert cli.ArgumentParser().allow_abbrev is False
    for root in ("megatron_jreg", "tools"):
        for base, _, files in os.walk(os.path.join(REPO, root)):
            for name in files:
                if not name.endswith(".py") or name == "cli.py":
                    continue
                tree = ast.parse(open(os.path.join(base, name)).read())
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and getattr(node.func, "attr",
                                                              "") == "ArgumentParser":
                        assert getattr(node.func.value, "id",
                                       "") == "cli", f"{name}: argparse's parser"


# ---- the model: presets are flag bundles, Megatron-LM command lines read as Megatron-LM ------

def test_presets_are_bundles_of_the_same_flags():
    for preset in PRESETS:
        bundle = parse(["--data-path", "x"] + preset_flags(preset))["model"]
        named = parse(["--data-path", "x", "--model-preset", preset])["model"]
        assert dataclasses.replace(named, model_preset=None) == bundle
    c = parse(["--data-path", "x", "--model-preset", "3b", "--num-layers", "2", "--hidden-dropout",
               "0.1"])
    assert (c["model"].num_layers, c["model"].hidden_size, c["model"].hidden_dropout) == (2, 3072,
                                                                                          0.1)


def test_megatron_lm_llama2_command_line_gives_the_tiny_preset_model():
    for dtype in ([], ["--bf16"]):
        argv = ["--data-path", "x"] + LLAMA2_MODEL.split() + LLAMA2_RUN.split() + dtype
        model = parse(argv)["model"]
        preset = parse(["--data-path", "x", "--model-preset", "tiny", "--transformer-impl", "local"]
                       + dtype)["model"]
        assert model.max_positions == preset.max_positions == 128
        assert dataclasses.replace(model, max_position_embeddings=None) == dataclasses.replace(
            preset, model_preset=None)


def test_megatron_lm_llama2_command_line_trains_like_the_preset(demo_data, tmp_path):
    """Only the entry point changed: the Megatron-LM flags train, each implementation flag
    that does not apply here says so in one line, and the run is the tiny preset's run."""
    runs = {}
    for name, model_flags in (("megatron_lm", LLAMA2_MODEL.split()),
                              ("preset",
                               ["--model-preset", "tiny", "--transformer-impl", "local"])):
        metrics = tmp_path / f"{name}.jsonl"
        proc = train(model_flags + LLAMA2_RUN.split() + ["--data-path", demo_data,
                                                          "--metrics-file", str(metrics)])
        runs[name] = steps(metrics)
        log = proc.stdout + proc.stderr
        assert log.count("--use-flash-attn: ignored") == 1
        assert log.count("--num-workers 2: batches are read in the training process") == 1
        assert "--timing-log-level" not in log  # 0: nothing to say
        # the attention the run built, and why (auto without TE: SDPA, on every device)
        assert "core attention: sdpa (no Transformer Engine: PyTorch's SDPA" in log
    assert [r[0] for r in runs["preset"]] == ["1", "2"]  # --train-samples 16 / 8 per step
    assert runs["megatron_lm"] == runs["preset"]


def test_gpt3_command_line_builds_megatron_lms_gpt_form():
    """Megatron-LM's GPT-3 flags (examples/gpt3) build LayerNorm, GeLU, learned positions,
    biases and tied embeddings: that model, the GPT-2 family, never the Llama form."""
    m = parse(["--data-path", "x", "--num-layers", "4", "--hidden-size", "64",
               "--num-attention-heads", "4", "--seq-length", "64",
               "--max-position-embeddings", "64"])["model"]
    assert (m.swiglu, m.normalization, m.position_embedding_type) == (False, "LayerNorm",
                                                                      "learned_absolute")
    assert m.add_bias_linear and not m.untie_embeddings_and_output_weights
    assert m.ffn_size == 256 and m.query_groups == 4 and m.family == "gpt2"
    m = parse(["--data-path", "x", "--model-preset", "tiny", "--normalization",
               "LayerNorm"])["model"]
    assert m.normalization == "LayerNorm" and m.family == "other"


def test_megatron_lm_defaults_apply_under_its_sizing():
    llama = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    m = parse(["--data-path", "x", "--num-layers", "2", "--hidden-size", "256",
               "--num-attention-heads", "4", "--num-query-groups", "2"] + llama)["model"]
    assert (m.hidden_dropout, m.attention_dropout) == (0.1, 0.1)  # Megatron-LM's defaults
    assert m.ffn_size == 640  # int(4 * 256 * 2 / 3 / 64) * 64
    assert m.query_groups == 4  # --num-query-groups needs --group-query-attention
    assert m.attention_softmax_in_fp32 is False
    m = parse(["--data-path", "x", "--num-layers", "2", "--group-query-attention"] + llama)["model"]
    assert m.query_groups == 1  # Megatron-LM's --num-query-groups default
    m = parse(["--data-path", "x", "--use-rotary-position-embeddings", "--model-preset",
               "tiny"])["model"]
    assert m.position_embedding_type == "rope"


@pytest.mark.parametrize("argv, message", [
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5: not supported yet"),
    (["--kv-channels", "32"], "--kv-channels 32: not supported yet"),
    (["--position-embedding-type", "none"], "--position-embedding-type none: not supported yet"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk 5 must be between 1"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes"),
    (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "3"],
     "--hierarchical-context-parallel-sizes 2 3: their product must be --context-parallel-size 4"),
    (["--rampup-batch-size", "16", "16", "1000"], "--rampup-batch-size: not supported yet"),
    (["--dataloader-type", "external"], "--dataloader-type 'external'"),
    (["--reset-attention-mask"], "--reset-attention-mask: not supported yet"),
    (["--tokenizer-type", "TikTokenizer"],
     "--tokenizer-type TikTokenizer (Megatron-LM's) is not supported here: use "
     "HuggingFaceTokenizer"),
    (["--vocab-file", "gpt2-vocab.json"], "pass --tokenizer-type GPT2BPETokenizer"),
    (["--train-iters", "10", "--train-samples", "1000"], "--train-iters and --train-samples"),
    (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], "pass one warmup length"),
    (["--num-layers-per-virtual-pipeline-stage", "1", "--virtual-pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2"], None),
])
def test_unsupported_math_is_refused_by_name(argv, message, capsys):
    argv = ["--data-path", "x", "--model-preset", "tiny"] + argv
    if message is None:  # refused by the pre-work checks
        with pytest.raises(ValueError, match="pass one"):
            c = parse(argv)
            c["parallel"].virtual_stages(c["model"].num_layers)
        return
    assert message in refused(argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (["--position-embedding-type", "learned_absolute", "--no-position-embedding"],
     "--no-position-embedding with --position-embedding-type learned_absolute"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"],
     "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (["--num-experts", "3", "--moe-router-topk", "2", "--expert-model-parallel-size", "2"],
     "--expert-model-parallel-size 2 must divide --num-experts 3"),
    (["--expert-model-parallel-size", "2"], "needs a mixture-of-experts model"),
])
def test_mixes_megatron_fails_on_mid_run_are_refused_before_work(argv, message):
    c = parse(["--data-path", "x", "--model-preset", "tiny"] + argv)
    with pytest.raises(ValueError, match=message.replace("+", r"\+")):
        ExperimentConfig.from_sections(c).validate(world_size=2)


def test_parallel_flags_map_as_in_megatron_lm():
    c = parse(["--data-path", "x", "--recompute-activations"])
    assert c["parallel"].recompute_granularity == "selective"
    for flag in ("--virtual-pipeline-model-parallel-size",
                 "--num-virtual-stages-per-pipeline-rank"):
        c = parse(["--data-path", "x", "--model-preset", "tiny", "--pipeline-model-parallel-size",
                   "2",
                   flag, "2"])
        assert c["parallel"].virtual_stages(4) == 2
    per_stage = parse(["--data-path", "x", "--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"])["parallel"]
    assert per_stage.virtual_stages(4) == 2


def test_schedule_in_samples_as_megatron_lm(monkeypatch):
    """Megatron-LM's get_optimizer_param_scheduler: sample flags as given, iteration flags
    times the global batch, a warmup fraction of the decay length."""
    def scheduler(argv):
        c = parse(["--data-path", "x", "--global-batch-size", "8", "--micro-batch-size", "8"]
                  + argv)
        return c, build_scheduler(SimpleNamespace(param_groups=[{}]), c["optim"], c["training"])

    c, s = scheduler(["--train-samples", "1001", "--lr-warmup-fraction", "0.01"])
    assert c["training"].train_iters == 125  # the partial last batch is dropped
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wd_incr_steps) == (pytest.approx(10.01), 1001,
                                                                      1001)
    c, s = scheduler(["--train-samples", "1000", "--lr-warmup-samples", "30", "--lr-decay-samples",
                      "900", "--lr-warmup-init", "1e-5"])
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.init_lr) == (30, 900, 1e-5)
    c, s = scheduler(["--train-iters", "100", "--lr-warmup-fraction", "0.1", "--lr-decay-iters",
                      "50"])
    assert (s.lr_warmup_steps, s.lr_decay_steps) == (40, 400)
    monkeypatch.setenv("WORLD_SIZE", "1")
    exp = ExperimentConfig.from_sections(parse(["--data-path", "x", "--train-samples", "80",
                                                "--lr-warmup-samples", "80"]))
    with pytest.raises(ValueError,
                       match="--lr-warmup-samples 80 must be below the decay length 80 samples"):
        exp._check_schedule()


def test_resumed_schedule_is_recorded_in_samples_when_not_whole_steps():
    o = OptimConfig(lr_warmup_fraction=0.01)
    o.keep_schedule(SimpleNamespace(max_lr=1e-3, min_lr=0.0, lr_decay_style="cosine", start_wd=0.1,
                                    lr_warmup_steps=10.01, lr_decay_steps=1000,
                                    wsd_decay_steps=None), 8)
    assert (o.lr_warmup_samples, o.lr_warmup_fraction, o.lr_decay_iters) == (10, None, 125)
    assert dataclasses.replace(o) == o  # still a valid config


def megatron_lm_cyclic_batches(total, consumed, mbs, dp_rank, dp):
    """Megatron-LM 0.16's MegatronPretrainingRandomSampler (data sharding on, its default),
    iterated as its cyclic data iterator does: a new epoch when one ends."""
    import torch

    per_round = mbs * dp
    active = total - total % per_round
    while True:
        epoch, current = divmod(consumed, active)
        bucket = total // per_round * mbs
        g = torch.Generator()
        g.manual_seed(epoch)
        order = torch.randperm(bucket, generator=g).tolist()
        batch = []
        for idx in [dp_rank * bucket + x for x in order[current // dp:]]:
            batch.append(idx)
            if len(batch) == mbs:
                consumed += per_round
                yield batch
                batch = []


@pytest.mark.parametrize("total, mbs, dp", [(37, 2, 2), (40, 4, 1), (25, 1, 3)])
def test_cyclic_order_is_megatron_lms_sampler(total, mbs, dp):
    """rank_microbatches over the CyclicOrder view asks for the samples Megatron-LM's cyclic
    sampler gives each DP rank, step after step across epochs (and from a resumed step)."""
    import torch

    from megatron_jreg.data.datasets.batches import rank_microbatches
    from megatron_jreg.data.datasets.sample_order import CyclicOrder

    dataset = [{"tokens": [i]} for i in range(total)]
    num_mb = 2
    for resume_step in (0, 7):
        view = CyclicOrder(dataset, mbs, dp)
        for rank in range(dp):
            reference = megatron_lm_cyclic_batches(total, resume_step * num_mb * mbs * dp, mbs,
                                                   rank, dp)
            for step in range(resume_step, resume_step + 12):  # several epochs
                got = rank_microbatches(view, step * num_mb * mbs * dp, mbs, num_mb, rank, dp,
                                        torch.device("cpu"))
                for batch in got:
                    assert batch["tokens"][:, 0].tolist() == next(reference)


def test_documented_command_runs_as_written(demo_data, tmp_path):
    """docs/megatron_lm_flags.md's command line, as written, on the demo data."""
    import subprocess

    doc = open(os.path.join(REPO, "docs", "megatron_lm_flags.md")).read()
    block = doc.split("```bash\n", 1)[1].split("```", 1)[0]
    env = dict(run_env(), DATA_PATH=demo_data, TRAIN_SAMPLES="16", RUN_DIR=str(tmp_path))
    proc = subprocess.run(["bash", "-c", block], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 2 steps" in proc.stdout


# ---- runs: overlap at DP 2, --exit-signal, --exit-duration-in-mins, Megatron-LM tokenizers ---

def test_overlapped_grad_reduce_and_param_gather_at_dp2_match_the_plain_run(demo_data, tmp_path):
    """On gloo at DP 2 with the distributed optimizer: the same losses with and without the
    overlap, and a checkpoint saved under the overlap resumes into the plain run's steps."""
    common = dict(micro_batch_size=2, global_batch_size=8, use_distributed_optimizer=True,
                  eval_interval=2, eval_iters=1, train_iters=4, log_interval=1)
    overlap = {"overlap-grad-reduce": True, "overlap-param-gather": True}
    plain, over = tmp_path / "plain.jsonl", tmp_path / "over.jsonl"
    train(base_args(demo_data, metrics_file=plain, **common), nproc=2)
    train(base_args(demo_data, metrics_file=over, **common, **overlap), nproc=2)
    assert steps(plain) == steps(over)
    ckpt, resumed = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    train(base_args(demo_data, **dict(common, train_iters=2), save=ckpt, lr_decay_iters=4,
                    **overlap), nproc=2)
    train(base_args(demo_data, **common, load=ckpt, save=ckpt, metrics_file=resumed), nproc=2)
    assert steps(resumed) == steps(plain)[2:]


def test_exit_signal_sigusr1_saves_and_exits(demo_data, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    ckpt = tmp_path / "ckpt"
    argv = base_args(demo_data, train_iters=100000, save=ckpt, save_interval=100000, seq_length=32,
                     exit_signal="SIGUSR1")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_jreg.train"] + argv, cwd=REPO,
                            env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.time() + 300
    for line in proc.stdout:
        if line.startswith("iteration"):
            break
        assert time.time() < deadline
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "signal received: saving at iteration" in out
    assert (ckpt / "latest_checkpointed_iteration.txt").exists()


def test_exit_duration_in_mins_saves_and_exits(demo_data, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = train(base_args(demo_data, train_iters=50, save=ckpt, exit_duration_in_mins=0))
    assert "--exit-duration-in-mins 0.0 reached: saving at iteration 1" in proc.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"


def test_exit_on_missing_checkpoint_stops_before_any_work(demo_data, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = base_args(demo_data, load=empty, exit_on_missing_checkpoint=True)
    proc = train(argv, check=False)
    assert proc.returncode == 2 and "no whole iter_XXXXXXX directory" in proc.stderr
    assert "iteration" not in proc.stdout


def test_null_tokenizer_counts_its_end_of_document_id(demo_data, tmp_path):
    """--tokenizer-type NullTokenizer --vocab-size V: V ids and the EOD id V, so V + 1 rows
    before padding (the byte demo data's ids are below 300)."""
    import yaml

    ckpt = tmp_path / "ckpt"
    train(base_args(demo_data, tokenizer_type="NullTokenizer", vocab_size=300, train_iters=1,
                    save=ckpt))
    saved = yaml.safe_load(open(ckpt / "iter_0000001" / "run_config.yaml"))
    assert saved["model"]["vocab_size"] == 301 and saved["model"]["padded_vocab"] == 384
    assert saved["data"]["tokenizer_type"] == "NullTokenizer"


def test_megatron_lm_line_validates_for_its_world(demo_data, monkeypatch):
    argv = (LLAMA2_MODEL.split() + LLAMA2_RUN.split() + ["--bf16", "--data-path", demo_data,
                                                        "--use-distributed-optimizer",
                                                        "--overlap-param-gather"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    exp = from_argv(argv)
    exp.validate(tokenizer_vocab_size=259)
    assert exp.model.bf16 and exp.parallel.overlap_param_gather
    assert exp.data.dataloader_type == "cyclic"


def test_docs_preset_table_is_the_code_bundles():
    from megatron_jreg.config.presets import FAMILY_FLAGS, LLAMA_FLAGS, PRESETS_BY_FAMILY

    doc = open(os.path.join(REPO, "docs", "megatron_lm_flags.md")).read()
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines()
            if line.strip().startswith("| ") and line.count("|") == 3}
    assert f"`{LLAMA_FLAGS}`" in rows["Llama form"]
    for name, (family, sizes) in PRESETS_BY_FAMILY.items():
        assert f"`{sizes}" in rows[name], name
        flags = FAMILY_FLAGS[family]
        if flags.startswith(LLAMA_FLAGS):
            assert "the Llama form" in rows[name], name
            flags = flags[len(LLAMA_FLAGS):].strip()
        assert flags in rows[name], name
