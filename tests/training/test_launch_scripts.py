"""The GPU launch scripts (examples/pretrain_{170m,1b,3b}_*.sh, the alpha sweep): run them with
stand-in `torchrun`/`python` that record the command, then parse it with the trainer's own
parser and run the trainer's pre-work validation for an 8-GPU node; and run each size's
script itself with real torchrun on 2 CPU processes at tiny sizes."""

import json
import os
import subprocess

import pytest
from trainer_runs import REPO

from megatron_jreg.commands import flags as cli
from megatron_jreg.config.model import PRESETS
from megatron_jreg.config.run import BUILDERS, SECTIONS
from megatron_jreg.training.experiment import ExperimentConfig

RECORDER = """#!/bin/sh
# stand-in for {name}: one line per call, arguments separated by the unit separator
printf '%s\\037' "{name}" "$@" >> "$LAUNCH_LOG"
printf '\\n' >> "$LAUNCH_LOG"
"""


def launch(tmp_path, script, data_prefix, **env_overrides):
    """The trainer commands a script would run, as (launcher argv, trainer argv) pairs."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for name in ("torchrun", "python"):
        (bindir / name).write_text(RECORDER.format(name=name))
        (bindir / name).chmod(0o755)
    log = tmp_path / "launches.log"
    log.write_text("")
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", LAUNCH_LOG=str(log),
               GPUS_PER_NODE="8", DATA_PATH=data_prefix, TOKENIZER_MODEL="/models/tokenizer.model",
               RUN_DIR=str(tmp_path / "run"))
    env.pop("EXTRA_ARGS", None)
    env.update(env_overrides)
    proc = subprocess.run(["bash", os.path.join(REPO, "examples", script)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = []
    for line in log.read_text().splitlines():
        argv = line.split("\037")[:-1]
        cut = argv.index("megatron_jreg.train")
        calls.append((argv[:cut - 1], argv[cut + 1:]))
    return calls


def validated(argv, monkeypatch, world_size=8):
    """The parsed configs, after the trainer's checks that run before any work."""
    configs = cli.parse(SECTIONS, argv, build=BUILDERS)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    ExperimentConfig.from_sections(configs).validate()
    return configs


@pytest.mark.parametrize("preset, tp", [("170m", 1), ("1b", 1), ("3b", 2)])
def test_gpu_scripts_launch_a_valid_8_gpu_run(preset, tp, demo_data, tmp_path, monkeypatch):
    [(launcher, argv)] = launch(tmp_path, f"pretrain_{preset}_jreg.sh", demo_data)
    assert launcher == ["torchrun", "--standalone", "--nproc_per_node", "8"]
    c = validated(argv, monkeypatch)
    model, par, train = c["model"], c["parallel"], c["training"]
    assert model.num_layers == PRESETS[preset]["num_layers"]
    assert model.hidden_size == PRESETS[preset]["hidden_size"]
    assert par.tensor_model_parallel_size == tp and par.sequence_parallel == (tp > 1)
    assert model.bf16 and c["optim"].use_distributed_optimizer
    # Megatron-LM's DDP flags with the distributed optimizer (its Llama 3 and Mixtral
    # examples), at every size: under pure data parallelism (170m, 1b) this is all the
    # communication there is
    assert par.overlap_grad_reduce and par.overlap_param_gather
    assert model.seq_length == 2048 and train.train_iters == 200_000
    dp = 8 // (tp * par.pipeline_model_parallel_size)
    assert train.global_batch_size % (train.micro_batch_size * dp) == 0
    assert c["jreg"].lam == 1.0 and c["jreg"].alpha == 1.0
    assert c["checkpoint"].save == str(tmp_path / "run" / "checkpoints")
    assert c["checkpoint"].load is None  # nothing saved yet: a fresh run


@pytest.mark.parametrize("jreg_script, baseline_script", [
    ("pretrain_3b_jreg.sh", "pretrain_3b_baseline.sh"),
    ("pretrain_1b_jreg_long_context.sh", "pretrain_1b_baseline_long_context.sh"),
])
def test_baseline_twin_differs_only_in_lambda(jreg_script, baseline_script, demo_data, tmp_path,
                                              monkeypatch):
    [(_, jreg)] = launch(tmp_path, jreg_script, demo_data)
    [(_, base)] = launch(tmp_path, baseline_script, demo_data)
    a, b = validated(jreg, monkeypatch), validated(base, monkeypatch)
    assert b["jreg"].lam == 0.0 and a["jreg"].lam == 1.0
    for section in ("model", "parallel", "optim", "training", "data"):
        assert a[section] == b[section], section


def test_long_context_script_is_the_1b_run_with_32k_sequences_over_cp4(demo_data, tmp_path,
                                                                       monkeypatch):
    """pretrain_1b_jreg_long_context.sh is pretrain_1b_jreg.sh's run (model, JREG, optimizer,
    schedule, tokens per step) with 32768-token sequences split over CP 4 (CP 4 x DP 2 on one
    8-GPU node), micro-batch 1 and RoPE base 500000, in its own run directory."""
    import dataclasses

    [(launcher, argv)] = launch(tmp_path, "pretrain_1b_jreg_long_context.sh", demo_data, RUN_DIR="")
    [(_, short_argv)] = launch(tmp_path, "pretrain_1b_jreg.sh", demo_data, RUN_DIR="")
    assert launcher == ["torchrun", "--standalone", "--nproc_per_node", "8"]
    c, short = validated(argv, monkeypatch), validated(short_argv, monkeypatch)
    model, par, train = c["model"], c["parallel"], c["training"]
    assert (model.seq_length, model.max_position_embeddings, model.rotary_base) == (32768, 32768,
                                                                                    500000)
    assert short["model"].rotary_base == 10000  # the preset's
    assert model == dataclasses.replace(short["model"], seq_length=32768,
                                        max_position_embeddings=32768, rotary_base=500000)
    assert (par.context_parallel_size, par.data_parallel_size(8)) == (4, 2)
    assert par == dataclasses.replace(short["parallel"], context_parallel_size=4)
    assert (train.micro_batch_size, train.global_batch_size) == (1, 16)
    assert train.global_batch_size * 32768 == short["training"].global_batch_size * 2048
    assert train == dataclasses.replace(short["training"], micro_batch_size=1, global_batch_size=16)
    for section in ("optim", "jreg", "data"):
        assert c[section] == short[section], section
    assert c["jreg"].lam == 1.0 and c["jreg"].alpha == 1.0
    assert c["checkpoint"].save == os.path.join(REPO, "runs", "1b_seq32768_lambda1.0_alpha1.0",
                                                "checkpoints")
    assert short["checkpoint"].save == os.path.join(REPO, "runs", "1b_lambda1.0_alpha1.0",
                                                    "checkpoints")


def test_long_context_seq_length_keeps_the_tokens_per_step(demo_data, tmp_path, monkeypatch):
    [(_, argv)] = launch(tmp_path, "pretrain_1b_jreg_long_context.sh", demo_data,
                         SEQ_LENGTH="65536")
    c = validated(argv, monkeypatch)
    assert (c["model"].seq_length, c["model"].max_position_embeddings) == (65536, 65536)
    assert c["training"].global_batch_size == 8
    env = dict(os.environ, GPUS_PER_NODE="8", DATA_PATH=demo_data, TOKENIZER_MODEL="/t",
               SEQ_LENGTH="3000")
    proc = subprocess.run(["bash",
                           os.path.join(REPO, "examples", "pretrain_1b_jreg_long_context.sh")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("error: SEQ_LENGTH 3000 must divide 524288 (2^19 tokens per step): "
                           "pass a power of two\n")


def test_rerun_resumes_and_extra_args_override(demo_data, tmp_path, monkeypatch):
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2000")
    [(_, argv)] = launch(tmp_path, "pretrain_170m_jreg.sh", demo_data,
                         EXTRA_ARGS="--micro-batch-size 8 --recompute-granularity selective")
    c = validated(argv, monkeypatch)
    assert c["checkpoint"].load == str(ckpt)
    assert c["training"].micro_batch_size == 8
    assert c["parallel"].recompute_granularity == "selective"


def test_alpha_sweep_runs_the_paper_grid(demo_data, tmp_path, monkeypatch):
    # RUN_DIR unset: each run picks its own directory from lambda and alpha
    calls = launch(tmp_path, "sweep_alpha_170m.sh", demo_data, RUN_DIR="")
    runs = [validated(argv, monkeypatch) for _, argv in calls]
    grid = [(r["jreg"].lam, r["jreg"].alpha) for r in runs]
    assert grid == [(0.0, 1.0)] + [(1.0, a) for a in (0.0, 0.1, 0.3, 0.5, 1.0, 3.0)]
    saves = {r["checkpoint"].save for r in runs}
    assert len(saves) == len(runs), "two sweep runs would share a checkpoint directory"


def test_3b_script_builds_its_model_without_the_cpu_platform(demo_data, tmp_path):
    """The 3B script's exact model and layout flags (TP=2 + sequence parallelism, bf16,
    --transformer-impl auto), at 2 layers, built by 2 ranks in processes where the CPU
    redirection never ran (tests/platform/gpu_path_worker.py): what a GPU node builds
    without Transformer Engine. Its norms run forward and backward on the SP shards."""
    import dataclasses
    import json
    import sys

    from trainer_runs import run_env

    [(_, argv)] = launch(tmp_path, "pretrain_3b_jreg.sh", demo_data)
    c = cli.parse(SECTIONS, argv, build=BUILDERS)
    assert c["model"].transformer_impl == "auto" and c["parallel"].sequence_parallel
    model = dict(dataclasses.asdict(c["model"]), num_layers=2, vocab_size=32000)
    case = {"model": model, "parallel": dataclasses.asdict(c["parallel"])}
    out = tmp_path / "out"
    out.mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(out), "cases": {"3b": case}}))
    worker = os.path.join(REPO, "tests", "platform", "gpu_path_worker.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", worker, str(spec)], env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    for rank in range(2):
        report = json.loads((out / f"rank{rank}.json").read_text())
        got = report["cases"]["3b"]
        assert report["cpu_redirection_active"] is False
        assert got["ok"], got.get("error")
        assert got["layers"] == [1, 2] and got["norms_sp_marked"] is True
        assert got["norms_run"] == 5 and got["norm_grads_finite"]
        assert got["embedding_rows"] == [32000 // 2]  # 32000 is a multiple of 128: no padding
        # half of each TP-split matrix per rank: 2 layers + embedding + output layer
        h, ffn = PRESETS["3b"]["hidden_size"], PRESETS["3b"]["ffn_hidden_size"]
        kv = h // PRESETS["3b"]["num_attention_heads"] * PRESETS["3b"]["num_query_groups"]
        layer = (h * (h + 2 * kv) + h * h + 3 * h * ffn) // 2 + 2 * h
        assert got["params_on_rank"] == 2 * layer + 2 * 32000 * h // 2 + h


def test_sft_3b_script_runs_the_papers_recipe_on_both_checkpoints(sft_data, tmp_path, monkeypatch):
    """examples/sft_3b.sh: the paper's SFT recipe (lr 2e-5 linear, AdamW (0.9, 0.95), global
    batch 512, 957 steps) from each pretrained checkpoint, each into its own directory."""
    base, jreg = tmp_path / "base_ckpt", tmp_path / "jreg_ckpt"
    base.mkdir()
    jreg.mkdir()
    calls = launch(tmp_path, "sft_3b.sh", sft_data, SFT_DATA_PATH=sft_data, BASELINE_CKPT=str(base),
                   JREG_CKPT=str(jreg), OUT=str(tmp_path / "sft"), TOKENIZER_TYPE="ByteTokenizer")
    runs = [validated(argv, monkeypatch) for _, argv in calls]
    assert [r["checkpoint"].pretrained_checkpoint for r in runs] == [str(base), str(jreg)]
    assert [r["checkpoint"].save for r in runs] == [str(tmp_path / "sft" / n / "checkpoints")
                                                     for n in ("baseline", "jreg")]
    for r in runs:
        o, t = r["optim"], r["training"]
        assert r["data"].sft and r["checkpoint"].finetune and r["checkpoint"].load is None
        assert (o.lr, o.min_lr, o.lr_decay_style, o.lr_warmup_iters) == (2e-5, 0.0, "linear", 0)
        assert (o.adam_beta1, o.adam_beta2) == (0.9, 0.95)
        assert (t.global_batch_size, t.train_iters) == (512, 957)
        assert r["model"].model_preset == "3b" and r["model"].seq_length == 2048
        assert r["parallel"].overlap_grad_reduce and r["parallel"].overlap_param_gather


@pytest.mark.parametrize("script, preset, layout", [
    ("pretrain_170m_jreg.sh", "170m",
     ("tensor_model_parallel_size: 1", "sequence_parallel: false")),
    ("pretrain_1b_baseline.sh", "1b",
     ("tensor_model_parallel_size: 1", "sequence_parallel: false")),
    ("pretrain_3b_jreg.sh", "3b", ("tensor_model_parallel_size: 2", "sequence_parallel: true")),
])
def test_gpu_scripts_train_as_written_at_tiny_sizes(script, preset, layout, demo_sp_data, tmp_path):
    """The script itself (real torchrun, 2 CPU processes): its layout (data parallel for
    170m and 1b, TP2 + sequence parallelism for 3b), bf16, the distributed optimizer with
    its overlapped communication and the paper's schedule flags train; only the sizes and step
    counts come from EXTRA_ARGS, as a user shrinks it. A baseline script trains with lambda 0,
    the others with 1."""
    from trainer_runs import run_env

    data, tokenizer = demo_sp_data
    tiny = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
            "--ffn-hidden-size 128 --seq-length 64 --micro-batch-size 2 --global-batch-size 4 "
            "--train-iters 3 --lr-warmup-iters 1 --save-interval 3 --eval-interval 3 "
            "--eval-iters 1 --log-interval 1")
    run_dir = tmp_path / "run"
    env = dict(run_env(), GPUS_PER_NODE="2", DATA_PATH=data, TOKENIZER_MODEL=tokenizer,
               RUN_DIR=str(run_dir), EXTRA_ARGS=tiny)
    env.pop("JREG_LAMBDA", None)
    proc = subprocess.run(["bash", f"examples/{script}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    rows = [r for r in map(json.loads, open(run_dir / "metrics.jsonl")) if "lm_loss" in r]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    if "baseline" in script:
        assert all(r["jreg_penalty"] == 0 for r in rows)
    else:  # JREG_LAMBDA defaults to 1.0
        assert all(r["jreg_penalty"] > 0 for r in rows)
    tracker = run_dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == "3"
    config = (run_dir / "checkpoints" / "iter_0000003" / "run_config.yaml").read_text()
    for setting in (f"model_preset: {preset}", *layout, "bf16: true",
                    "use_distributed_optimizer: true", "overlap_grad_reduce: true",
                    "overlap_param_gather: true", "weighting: softmax"):
        assert setting in config, setting


def test_long_context_script_trains_at_cp2_as_one_rank(demo_sp_data, tmp_path):
    """pretrain_1b_jreg_long_context.sh itself at a tiny size: real torchrun, 2 CPU processes
    at CP 2 (the script's CP 4 needs 4 ranks per data-parallel replica), each holding two of
    the four chunks of every 64-token sequence, with the script's micro-batch 1, RoPE base,
    bf16 and distributed optimizer. The same script on one process (CP 1) is the reference:
    the same losses, per-layer Psi, zeta_L and grad norms (bf16 tolerances)."""
    from trainer_runs import run_env

    data, tokenizer = demo_sp_data
    tiny = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-query-groups 2 "
            "--ffn-hidden-size 128 --seq-length 64 --global-batch-size 4 --train-iters 3 "
            "--lr-warmup-iters 1 --save-interval 3 --eval-interval 3 --eval-iters 1 --log-interval "
            "1")
    runs = {}
    for cp in (2, 1):
        run_dir = tmp_path / f"cp{cp}"
        env = dict(run_env(), GPUS_PER_NODE=str(cp), DATA_PATH=data, TOKENIZER_MODEL=tokenizer,
                   RUN_DIR=str(run_dir), EXTRA_ARGS=f"{tiny} --context-parallel-size {cp}")
        env.pop("JREG_LAMBDA", None)
        env.pop("SEQ_LENGTH", None)
        proc = subprocess.run(["bash", "examples/pretrain_1b_jreg_long_context.sh"], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=900)
        log = proc.stdout + proc.stderr
        assert proc.returncode == 0, log[-5000:]
        layout = "TP 1, PP 1, CP 2, DP 1" if cp == 2 else "TP 1, PP 1, DP 1"
        assert f"world {cp} ({layout}), 4 micro-batches per step" in log
        runs[cp] = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        config = (run_dir / "checkpoints" / "iter_0000003" / "run_config.yaml").read_text()
        for setting in ("model_preset: 1b", f"context_parallel_size: {cp}", "rotary_base: 500000",
                        "max_position_embeddings: 32768", "micro_batch_size: 1", "bf16: true",
                        "use_distributed_optimizer: true", "weighting: softmax"):
            assert setting in config, setting
    cp2, cp1 = runs[2], runs[1]
    assert [r["iteration"] for r in cp2] == [r["iteration"] for r in cp1] == [1, 2, 3, 3]
    for a, b in zip(cp2, cp1):
        for key in ("lm_loss", "jreg_penalty", "grad_norm", "validation_lm_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-2), (a["iteration"], key)
        if "psi" in b:
            assert b["jreg_penalty"] > 0
            assert a["psi"] == pytest.approx(b["psi"], rel=1e-2)
            assert a["zeta_L"] == pytest.approx(b["zeta_L"], abs=1e-2)
