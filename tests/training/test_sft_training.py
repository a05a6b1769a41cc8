"""Supervised fine-tuning runs (``--sft``, ``--finetune``, ``--pretrained-checkpoint``).

References: the step's samples made by hand from the chat data (tests/sft_reference.py:
the tulu rendering, byte tokens, the loss mask on the assistant tokens shifted by one for
next-token prediction, padding); the loss and Psi of a step recomputed on them in plain
PyTorch on the Hugging Face export of the weights that step ran with (masked cross-entropy
over the global batch's assistant tokens, displacement over its non-padding tokens); one
rank for the TP2, PP2 and DP2 runs; an uninterrupted run for the resumed one.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from trainer_runs import REPO, base_args, read_metrics, run_env, train

import forked_trainer
from sft_reference import byte_tulu, reference_sample, sample_order

SEQ = 128
PRETRAIN = dict(train_iters=2, seq_length=64, jreg_lambda=0.0)


def tool(argv):
    proc = forked_trainer.run_tool(argv[0], argv[1:], run_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def pretrained_tp2(demo_data, tmp_path_factory):
    """Two pretraining steps of the tiny model at TP2: the weights SFT starts from."""
    save = str(tmp_path_factory.mktemp("pretrained") / "ckpt")
    train(base_args(demo_data, save=save, tensor_model_parallel_size=2, **PRETRAIN), nproc=2)
    return save


def sft_args(prefix, pretrained, **overrides):
    flags = dict(sft=True, seq_length=SEQ, pretrained_checkpoint=pretrained, finetune=True,
                 train_iters=4, lr=1e-3, lr_decay_style="cosine", jreg_lambda=0.5, split="90,10,0")
    flags.update(overrides)
    return base_args(prefix, **flags)


@pytest.fixture(scope="module")
def one_rank(sft_data, pretrained_tp2, tmp_path_factory):
    """SFT at TP1 from the TP2 checkpoint, every iteration saved."""
    root = tmp_path_factory.mktemp("sft_tp1")
    save, metrics = str(root / "ckpt"), str(root / "m.jsonl")
    proc = train(sft_args(sft_data, pretrained_tp2, save=save, load=save, save_interval=1,
                          metrics_file=metrics))
    return {"save": save, "rows": read_metrics(metrics), "log": proc.stdout + proc.stderr}


def export(save, iteration, out):
    tool(["tools/convert_to_hf.py", "--load", save, "--iteration", str(iteration), "--output", out])
    return out


# the sft_data fixture: 200 demo conversations, split 90,10,0 (the first 180 train), the
# byte tokenizer, whose EOD (256) the trainer pads with; the run's seed is base_args'
CONVERSATIONS, TRAIN_CONVERSATIONS, PAD, SEED = 200, 180, 256, 1234


def reference_samples(prefix, first, count):
    """Train samples ``first..first+count-1`` made from chat.jsonl by hand (tests/data/
    sft_reference.py): each conversation rendered with tulu, byte-tokenised, its loss mask
    the assistant contents and their EOS, shifted by one for next-token prediction."""
    path = os.path.join(os.path.dirname(prefix), "chat.jsonl")
    conversations = [json.loads(line)["messages"] for line in open(path, encoding="utf-8")]
    assert len(conversations) == CONVERSATIONS
    return [reference_sample(*byte_tulu(conversations[sample_order(i, TRAIN_CONVERSATIONS,
                                                                   SEED)]), SEQ, PAD)
            for i in range(first, first + count)]


def test_sft_samples_are_the_reference(sft_data):
    """The samples the trainer reads (build_sft_samples with the trainer's arguments) for
    the first two steps and one of the second epoch: tokens, labels, loss mask and token
    mask equal the reference's."""
    from megatron_jreg.data.datasets.sft_samples import build_sft_samples

    train_samples, _, _ = build_sft_samples([sft_data], "90,10,0", SEQ, SEED,
                                            TRAIN_CONVERSATIONS + 16, 0, PAD)
    for first in (0, 8, TRAIN_CONVERSATIONS + 3):
        for i, ref in enumerate(reference_samples(sft_data, first, 8), start=first):
            got = train_samples[i]
            for key, want in ref.items():
                assert got[key].tolist() == want.tolist(), (i, key)
            assert got["position_ids"].tolist() == list(range(SEQ))
    # the samples hold cut conversations (longer than SEQ + 1 tokens), short ones and
    # targets outside the loss mask
    refs = reference_samples(sft_data, 0, 16)
    assert any(r["token_mask"].all() for r in refs) and not all(r["token_mask"].all() for r in refs)
    assert all(0 < r["loss_mask"].sum() < r["token_mask"].sum() for r in refs)


def reference_step(hf_dir, prefix, iteration, micro_batch=4, global_batch=8):
    """Loss and Psi of training step ``iteration`` recomputed on an HF model in PyTorch, on
    the reference samples."""
    from transformers import AutoModelForCausalLM

    first = (iteration - 1) * global_batch
    samples = reference_samples(prefix, first, global_batch)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    captured = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: captured.append(o))]
    hooks += [layer.register_forward_hook(
        lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o))
        for layer in model.model.layers]
    loss_sum, loss_count, micro_means, psis = 0.0, 0.0, [], []
    for start in range(0, global_batch, micro_batch):
        micro = samples[start:start + micro_batch]
        batch = {k: torch.as_tensor(np.stack([s[k] for s in micro])) for k in micro[0]}
        captured.clear()
        with torch.no_grad():
            logits = model(batch["tokens"]).logits.float()
        ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"],
                                               reduction="none")
        mask = batch["loss_mask"].float()
        loss_sum += float((ce * mask).sum())
        loss_count += float(mask.sum())
        micro_means.append(float((ce * mask).sum() / mask.sum()))
        real = batch["token_mask"]
        psi = []
        for prev, nxt in zip(captured[:-1], captured[1:]):
            cos = torch.nn.functional.cosine_similarity(prev.double(), nxt.double(), dim=-1,
                                                        eps=1e-8)
            psi.append(float(((1 - cos) / 2)[real].mean()))
        psis.append(psi)
    for h in hooks:
        h.remove()
    return {"loss": loss_sum / loss_count, "mean_of_means": sum(micro_means) / len(micro_means),
            "psi": [sum(col) / len(col) for col in zip(*psis)]}


def test_sft_loss_is_the_masked_cross_entropy_of_the_global_batch(one_rank, sft_data, tmp_path):
    """Step 2 ran with the weights saved at iteration 1: its logged loss is the mean CE
    over the global batch's assistant tokens, and its Psi the displacement over the
    non-padding tokens, both recomputed on the HF export of those weights."""
    ref = reference_step(export(one_rank["save"], 1, str(tmp_path / "hf1")), sft_data, 2)
    row = one_rank["rows"][1]
    assert row["iteration"] == 2
    assert row["lm_loss"] == pytest.approx(ref["loss"], rel=2e-5)
    # the check tells the global token mean from the mean of micro-batch means
    assert abs(ref["mean_of_means"] - ref["loss"]) > 50 * 2e-5 * ref["loss"]
    assert row["psi"] == pytest.approx(ref["psi"], rel=2e-4, abs=1e-6)


def test_finetune_starts_from_the_tp2_weights_at_iteration_zero(one_rank, sft_data,
                                                                 pretrained_tp2, tmp_path):
    """Step 1 of the TP1 SFT run ran with the TP2 pretraining weights; the run starts at
    iteration 1 with a fresh schedule (the pretraining run's LR state is not loaded)."""
    rows = one_rank["rows"]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    assert "fine-tuning from --pretrained-checkpoint" in one_rank["log"]
    assert "padding" in one_rank["log"]  # the padding waste is reported
    ref = reference_step(export(pretrained_tp2, 2, str(tmp_path / "pre")), sft_data, 1)
    assert rows[0]["lm_loss"] == pytest.approx(ref["loss"], rel=2e-5)
    assert rows[0]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + np.cos(np.pi * 1 / 4)), rel=1e-6)


@pytest.mark.parametrize("layout", [{"tensor_model_parallel_size": 2},
                                    {"pipeline_model_parallel_size": 2},
                                    {"context_parallel_size": 2},
                                    {}])
def test_sft_layouts_equal_one_rank(one_rank, sft_data, pretrained_tp2, tmp_path, layout):
    """TP2, PP2, CP2 (each rank holds half of every conversation's tokens, and of its loss
    mask) and DP2 (``{}``: the per-token loss counts tokens over both DP ranks) equal one
    rank."""
    metrics = str(tmp_path / "m.jsonl")
    train(sft_args(sft_data, pretrained_tp2, metrics_file=metrics, **layout), nproc=2)
    got = read_metrics(metrics)
    for a, b in zip(one_rank["rows"], got):
        assert b["lm_loss"] == pytest.approx(a["lm_loss"], rel=1e-5)
        assert b["psi"] == pytest.approx(a["psi"], rel=1e-4, abs=1e-6)
        assert b["jreg_penalty"] == pytest.approx(a["jreg_penalty"], rel=1e-4)
    assert len(got) == 4


def test_sft_resume_is_exact(one_rank, sft_data, pretrained_tp2, tmp_path):
    """The same command twice (a requeued job): stopped at 2, then resumed from --load
    (not the pretrained weights again); iterations 3-4 equal the uninterrupted run."""
    save, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = sft_args(sft_data, pretrained_tp2, save=save, load=save, metrics_file=metrics)
    train(argv + ["--exit-interval", "2"])
    proc = train(argv)
    assert "loaded checkpoint" in proc.stdout + proc.stderr
    rows = read_metrics(metrics)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    for a, b in zip(one_rank["rows"], rows):
        assert b["lm_loss"] == a["lm_loss"] and b["psi"] == a["psi"]


def test_export_carries_the_chat_template(one_rank, sft_data, tmp_path):
    """The HF export of an SFT checkpoint renders a conversation to the tokens it was
    trained on (the template is in tokenizer_config.json)."""
    from transformers import AutoTokenizer

    from megatron_jreg.data.datasets.sft import SFTDataset

    out = export(one_rank["save"], 4, str(tmp_path / "hf"))
    config = json.load(open(os.path.join(out, "tokenizer_config.json")))
    dataset = SFTDataset(sft_data)
    assert config.get("chat_template") == dataset.chat_template
    tok = AutoTokenizer.from_pretrained(out)
    line = open(os.path.join(os.path.dirname(sft_data), "chat.jsonl")).readline()
    messages = json.loads(line)["messages"]
    ids = tok.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == dataset[0]["tokens"].tolist()


def test_eval_jump_reads_an_sft_checkpoint(one_rank, demo_data, tmp_path):
    out = str(tmp_path / "jump.json")
    tool(["tools/eval_jump.py", "--load", one_rank["save"], "--data-path", demo_data,
          "--seq-length", "64", "--max-tokens", "2048", "--json", out])
    report = json.load(open(out))
    report = report[0] if isinstance(report, list) else report
    assert report["num_layers"] == 4 and len(report["displacement"]) == 4
    assert all(0.0 < p < 1.0 for p in report["displacement"])


@pytest.mark.parametrize("extra, expected", [
    (dict(num_layers=3), "--num-layers 4 (this run: 3)"),
    (dict(data_path=None), "--sft"),
])
def test_sft_errors_are_one_line_before_training(sft_data, demo_data, pretrained_tp2, tmp_path,
                                                 extra, expected):
    flags = dict(extra)
    prefix = sft_data
    if "data_path" in flags:  # a pretraining dataset given to --sft: no loss mask beside it
        flags.pop("data_path")
        prefix = demo_data
    proc = train(sft_args(prefix, pretrained_tp2, **flags), check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(err) == 1 and expected in err[0], err
    assert "lm loss" not in proc.stdout


def test_docs_sft_training_command_runs_as_written(demo_sp_data, tmp_path):
    """docs/sft.md's `--sft` command, as written, in a directory holding what it names:
    data/ (the demo's sentencepiece tokenizer and chat data made with it) and runs/base (a
    tiny model pretrained on the demo text with that tokenizer)."""
    import re
    import shlex

    text_prefix, sp_model = demo_sp_data
    doc = open(os.path.join(REPO, "docs", "sft.md"), encoding="utf-8").read()
    block = re.search(r"## Training: `--sft`\s+```bash\n(.*?)```", doc, re.S).group(1)
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "megatron_jreg.train"]
    data = tmp_path / "data"
    data.mkdir()
    os.symlink(sp_model, data / "tokenizer.model")
    tool(["tools/make_demo_corpus.py", "--chat", "--output", str(data / "chat.jsonl")])
    tool(["tools/preprocess_data.py", "--sft", "--input", str(data / "chat.jsonl"),
          "--output-prefix", str(data / "chat"), "--tokenizer-type", "GPTSentencePieceTokenizer",
          "--tokenizer-model", sp_model, "--workers", "1"])
    train(base_args(text_prefix, tokenizer_type="GPTSentencePieceTokenizer",
                    tokenizer_model=sp_model,
                    seq_length=192, train_iters=2, save=tmp_path / "runs" / "base" / "checkpoints"))
    proc = subprocess.run([sys.executable] + argv[1:], cwd=tmp_path, env=run_env(),
                          capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "fine-tuning from --pretrained-checkpoint runs/base/checkpoints" in log
    assert (tmp_path / "runs" / "sft" / "checkpoints" / "latest_checkpointed_iteration.txt"
            ).read_text().strip() == "20"
