"""tools/convert_to_hf.py: the weight mapping, the tokenizer, and logits equal to ours."""

import json
import os
import subprocess
import sys

import pytest
import torch
from checkpoint_runs import REPO, SEQ, run_tool

from megatron_jreg.checkpoint.to_hf import (
    byte_tokenizer_fast,
    megatron_to_hf_state_dict,
    split_qkv,
)
from megatron_jreg.commands.convert_to_hf import main

transformers = pytest.importorskip("transformers")


# ---- the mapping, without a checkpoint -----------------------------------------------------


def test_split_qkv_inverts_megatrons_grouped_layout():
    heads, groups, d, hidden = 6, 2, 3, 5
    q, k, v = (
        torch.randn(heads * d, hidden),
        torch.randn(groups * d, hidden),
        torch.randn(groups * d, hidden),
    )
    per = heads // groups
    fused = torch.cat(
        [
            torch.cat(
                [q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]]
            )
            for g in range(groups)
        ]
    )
    out = split_qkv(fused, heads, groups, d)
    assert torch.equal(out["q_proj"], q) and torch.equal(out["k_proj"], k)
    assert torch.equal(out["v_proj"], v)
    with pytest.raises(ValueError, match="linear_qkv has"):
        split_qkv(fused[:-1], heads, groups, d)


def test_mapping_covers_every_llama_weight():
    from transformers import LlamaConfig, LlamaForCausalLM

    L, h, heads, groups, ffn, vocab = 2, 16, 4, 2, 24, 40
    d = h // heads
    state = {
        "embedding.word_embeddings.weight": torch.randn(vocab, h),
        "decoder.final_layernorm.weight": torch.randn(h),
        "output_layer.weight": torch.randn(vocab, h),
        "output_layer._extra_state": None,
    }
    for i in range(L):
        p = f"decoder.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": torch.randn(h),
                p + "pre_mlp_layernorm.weight": torch.randn(h),
                p + "self_attention.linear_qkv.weight": torch.randn((heads + 2 * groups) * d, h),
                p + "self_attention.linear_proj.weight": torch.randn(h, h),
                p + "mlp.linear_fc1.weight": torch.randn(2 * ffn, h),
                p + "mlp.linear_fc2.weight": torch.randn(h, ffn),
            }
        )
    hf = megatron_to_hf_state_dict(state, L, heads, groups, d)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=ffn,
            num_hidden_layers=L,
            num_attention_heads=heads,
            num_key_value_heads=groups,
            tie_word_embeddings=False,
        )
    )
    expected = {k: v.shape for k, v in model.state_dict().items()}
    assert {k: v.shape for k, v in hf.items()} == expected
    gate, up = state["decoder.layers.1.mlp.linear_fc1.weight"].chunk(2)
    assert torch.equal(hf["model.layers.1.mlp.gate_proj.weight"], gate)
    assert torch.equal(hf["model.layers.1.mlp.up_proj.weight"], up)
    with pytest.raises(KeyError, match="no Llama counterpart"):
        megatron_to_hf_state_dict(
            {**state, "decoder.layers.0.extra.weight": torch.ones(1)}, L, heads, groups, d
        )


def test_byte_tokenizer_export_gives_the_trainers_ids():
    from megatron_jreg.data.tokenizers.build import ByteTokenizer

    ours = ByteTokenizer()
    hf = byte_tokenizer_fast(ours.eod, ours.bos, ours.pad)
    for text in ("Hello, world!", "  two  spaces\nnewline\ttab", "héllo ∑ 日本 🙂"):
        assert hf(text)["input_ids"] == ours.encode(text)
        assert hf.decode(ours.encode(text)) == text
    assert (hf.eos_token_id, hf.bos_token_id, hf.pad_token_id) == (256, 257, 258)


# ---- a real checkpoint -------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(trained_checkpoints, tmp_path_factory):
    """The TP2 run exported (its weights resharded to one process on the way)."""
    out = str(tmp_path_factory.mktemp("hf") / "tp2-hf")
    proc = run_tool("convert_to_hf.py", ["--load", trained_checkpoints["tp2"], "--output", out])
    assert proc.stdout.strip().endswith(f"wrote {out}") and "warning" not in proc.stderr
    return out


def test_config_json(exported):
    config = json.load(open(os.path.join(exported, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (
        64,
        192,
        4,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == 512 and config["tie_word_embeddings"] is False
    assert config["rms_norm_eps"] == 1e-5
    theta = config.get("rope_theta") or config["rope_parameters"]["rope_theta"]
    assert theta == 10000.0
    assert os.path.isfile(os.path.join(exported, "model.safetensors"))


def test_hf_logits_match_ours(exported, checkpoint_reference, checkpoint_text, trained_checkpoints):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokens = torch.load(checkpoint_text[1])
    with torch.no_grad():
        logits = model(input_ids=tokens).logits
    ours = checkpoint_reference[trained_checkpoints["tp2"]]["logits"]
    assert logits.shape == ours.shape == (8, SEQ, 512)
    diff = float((logits - ours).abs().max())
    print(f"HF vs megatron logits: max abs diff {diff:.3e}")
    assert diff < 1e-4
    tokenizer = AutoTokenizer.from_pretrained(exported)
    text = open(checkpoint_text[0]).readline().rstrip("\n")
    assert tokenizer(text)["input_ids"] == tokens[0].tolist()


def test_eval_jump_on_the_export_equals_the_trainers_psi(
    exported, checkpoint_reference, checkpoint_text, trained_checkpoints, tmp_path
):
    from megatron_jreg.commands.eval_jump import main as eval_jump_main

    out = tmp_path / "hf.json"
    assert (
        eval_jump_main(
            [
                "--hf-model",
                exported,
                "--text-file",
                checkpoint_text[0],
                "--seq-length",
                str(SEQ),
                "--json",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    psi = checkpoint_reference[trained_checkpoints["tp2"]]["psi"]
    assert report["tokens"] == 8 * SEQ
    assert report["displacement"] == pytest.approx(psi, abs=1e-6)


# ---- bad inputs ----------------------------------------------------------------------------


def run_error(capsys, argv):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_errors(capsys, tmp_path):
    out = tmp_path / "out"
    err = run_error(capsys, ["--load", tmp_path / "nope", "--output", out])
    assert "--load" in err and "no such directory" in err
    err = run_error(capsys, ["--load", tmp_path, "--output", out])
    assert "not a torch_dist checkpoint directory" in err
    run_dir = tmp_path / "run" / "iter_0000002"
    run_dir.mkdir(parents=True)
    (run_dir / "jreg_complete.json").write_text("{}")
    err = run_error(capsys, ["--load", tmp_path / "run", "--output", out])
    assert "run_config.yaml" in err
    err = run_error(capsys, ["--load", tmp_path / "run", "--output", tmp_path])
    assert "already exists" in err
    assert not os.path.exists(out)


def test_tool_usage_error_exits_2():
    proc = subprocess.run(
        [sys.executable, "tools/convert_to_hf.py", "--output", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--load" in proc.stderr
