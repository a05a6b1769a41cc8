"""tools/convert_from_hf.py: a Hugging Face model in, exactly.

On the real SmolLM2-135M-Instruct (30 layers, 9 heads, 3 KV heads, tied embeddings) and on
tiny random models of every family (Llama untied with GQA, Qwen3, Mixtral, GPT-2):
HF -> ours -> convert_to_hf gives the original tensors bit for bit and an equivalent
config; our model's logits equal the HF model's at TP1, PP2 and a TP that divides the
heads; eval_jump --load on the import equals eval_jump --hf-model on the original.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from checkpoint_runs import REPO, run_env

import forked_trainer
from session_cache import build_once

HERE = os.path.dirname(os.path.abspath(__file__))
ARCH_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
             "rms_norm_eps", "rope_parameters", "rope_theta", "tie_word_embeddings",
             "max_position_embeddings", "hidden_act", "attention_bias", "mlp_bias",
             "num_local_experts", "num_experts_per_tok", "n_embd", "n_layer", "n_head", "n_inner",
             "n_positions", "layer_norm_epsilon", "activation_function", "model_type",
             "use_sliding_window", "sliding_window")


def _env():
    env = run_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def _run(args, check=True, timeout=600):
    """``python SCRIPT ARGS``, forked from a process that has imported the trainer
    (tests/forked_trainer.py)."""
    proc = forked_trainer.run_tool(args[0], args[1:], _env(), timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _torchrun(n, args):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", str(n), *map(str, args)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _hf_logits(hf_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def _our_logits(ckpt, ids, tmp_path, tp=1, pp=1):
    ids_file, out = tmp_path / f"ids_{tp}_{pp}.pt", tmp_path / f"logits_{tp}_{pp}.pt"
    torch.save(ids, ids_file)
    worker = os.path.join(HERE, "import_logits_worker.py")
    if tp * pp == 1:
        _run([worker, ckpt, tp, pp, ids_file, out])
    else:
        _torchrun(tp * pp, [worker, ckpt, tp, pp, ids_file, out])
    return torch.load(out)


def _relative(ours, theirs):
    ours = ours[..., : theirs.shape[-1]]  # our vocabulary as padded: the extra rows are unused
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _assert_round_trip(hf_dir, ckpt, out_dir):
    from safetensors.torch import load_file

    _run(["tools/convert_to_hf.py", "--load", ckpt, "--output", out_dir])
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    back = load_file(os.path.join(out_dir, "model.safetensors"))
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    config_a = json.load(open(os.path.join(hf_dir, "config.json")))
    config_b = json.load(open(os.path.join(out_dir, "config.json")))
    for config in (config_a, config_b):  # no head_dim means hidden / heads
        if "num_attention_heads" in config and config.get("head_dim") is None:
            config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
        if "n_embd" in config and config.get("n_inner") is None:  # no n_inner: 4 x hidden
            config["n_inner"] = 4 * config["n_embd"]
    for key in ARCH_KEYS:
        assert config_a.get(key) == config_b.get(key), (key, config_a.get(key), config_b.get(key))
    return config_b


# ---- SmolLM2-135M-Instruct --------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_ckpt(smollm2_hf, tmp_path_factory):
    def build(directory):
        save = os.path.join(str(directory), "ckpt")
        proc = _run(["tools/convert_from_hf.py", "--hf-model", smollm2_hf, "--save", save])
        assert "wrote" in proc.stdout and "30 layers" in proc.stdout, proc.stdout
        return save

    return build_once(tmp_path_factory, "smollm2_ckpt", build)


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_hf):
    torch.manual_seed(0)
    ids = torch.randint(0, 49152, (2, 24))
    return ids, _hf_logits(smollm2_hf, ids)


def test_smollm2_round_trip_is_bit_exact(smollm2_hf, smollm2_ckpt, tmp_path):
    config = _assert_round_trip(smollm2_hf, smollm2_ckpt, tmp_path / "back")
    assert config["tie_word_embeddings"] is True and config["num_key_value_heads"] == 3
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    from transformers import AutoTokenizer

    text = "The jump sits in the last layer. Ünïcode 123."
    assert (AutoTokenizer.from_pretrained(tmp_path / "back")(text)["input_ids"]
            == AutoTokenizer.from_pretrained(smollm2_hf)(text)["input_ids"])


@pytest.mark.parametrize("tp,pp", [(1, 1), (1, 2), (3, 1)])
def test_smollm2_logits_equal_hf(smollm2_ckpt, smollm2_reference, tmp_path, tp, pp):
    ids, reference = smollm2_reference
    ours = _our_logits(smollm2_ckpt, ids, tmp_path, tp, pp)
    error = _relative(ours, reference)
    print(f"SmolLM2 TP{tp} PP{pp}: logits max relative difference {error:.2e}")
    assert error <= 1e-4


def test_smollm2_eval_jump_load_equals_hf_model(smollm2_hf, smollm2_ckpt, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text(
        "The river rose after three days of rain, and the bridge was closed to traffic.\n"
        "She opened the letter slowly, afraid of what the court had decided.\n"
        "Photosynthesis converts light energy into chemical energy stored in sugar.\n")
    reports = {}
    for kind, source in (("load", smollm2_ckpt), ("hf", smollm2_hf)):
        out = tmp_path / f"{kind}.json"
        _run(["tools/eval_jump.py", f"--{'load' if kind == 'load' else 'hf-model'}", source,
              "--text-file", text, "--seq-length", 64, "--json", out, "--no-progress"])
        reports[kind] = json.load(open(out))
    ours, theirs = reports["load"], reports["hf"]
    assert ours["tokens"] == theirs["tokens"] > 40
    assert ours["displacement"] == pytest.approx(theirs["displacement"], rel=1e-4)
    zeta_l = ours["jump_rate"]["L"]
    assert zeta_l == pytest.approx(theirs["jump_rate"]["L"], rel=1e-3) and zeta_l > 3
    print(f"SmolLM2 zeta_L {zeta_l:.2f}, Psi_30 {ours['displacement'][-1]:.4f}")
    # the real model's jump: the last layer moves far more than the middle ones
    assert ours["displacement"][-1] > 3 * ours["displacement"][15]


def test_tp_that_does_not_divide_the_heads_is_refused_before_writing(smollm2_hf, tmp_path):
    save = tmp_path / "tp2"
    proc = _run(["tools/convert_from_hf.py", "--hf-model", smollm2_hf, "--save", save,
                 "--tensor-model-parallel-size", 2], check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "convert_from_hf: error: 9 attention heads: TP must divide 9 (1, 3, 9); "
        "--tensor-model-parallel-size 2 does not")
    assert not save.exists() and os.listdir(tmp_path) == []
    proc = _run(["tools/convert_from_hf.py", "--hf-model", smollm2_hf, "--save", save,
                 "--pipeline-model-parallel-size", 4], check=False)
    assert proc.returncode == 2
    assert "30 layers: PP must divide 30 (1, 2, 3, 5, 6, 10, 15, 30)" in proc.stderr


# ---- tiny random models of every family -------------------------------------------------------


def _tiny_models():
    import transformers

    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=64, initializer_range=0.2)
    return {
        "llama": transformers.LlamaConfig(**common, intermediate_size=48, num_key_value_heads=2,
                                          rope_theta=5000.0, rms_norm_eps=1e-6,
                                          tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**common, intermediate_size=48, num_key_value_heads=2,
                                          head_dim=8, tie_word_embeddings=True,
                                          use_sliding_window=False),
        "mixtral": transformers.MixtralConfig(**common, intermediate_size=40, num_key_value_heads=4,
                                              num_local_experts=4, num_experts_per_tok=2,
                                              tie_word_embeddings=False, sliding_window=None),
        "gpt2": transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=4, n_head=4,
                                        n_positions=64,
                                        activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0, initializer_range=0.2),
    }


def _save_tiny(family, directory):
    import transformers
    from tiny_tokenizer import save_tokenizer

    config = _tiny_models()[family]
    torch.manual_seed(7)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm weight is seen
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(str(directory))
    return str(directory)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "gpt2"])
def test_tiny_family_round_trip_and_logits(family, tmp_path):
    hf_dir = _save_tiny(family, tmp_path / "hf")
    ckpt = str(tmp_path / "ckpt")
    _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", ckpt])
    _assert_round_trip(hf_dir, ckpt, tmp_path / "back")
    torch.manual_seed(1)
    ids = torch.randint(0, 96, (2, 12))
    reference = _hf_logits(hf_dir, ids)
    layouts = [(1, 1), (2, 1)] if family == "llama" else [(1, 1)]
    if family == "gpt2":
        layouts.append((1, 2))
    for tp, pp in layouts:
        error = _relative(_our_logits(ckpt, ids, tmp_path, tp, pp), reference)
        print(f"{family} TP{tp} PP{pp}: logits max relative difference {error:.2e}")
        assert error <= 1e-4, (tp, pp, error)


# ---- refusals ---------------------------------------------------------------------------------


def _config_dir(tmp_path, config):
    path = tmp_path / "cfg"
    config.save_pretrained(path)
    return path


@pytest.mark.parametrize("case,message", [
    ("llama3_rope", "RoPE scaling of type 'llama3'"),
    ("attention_bias", "attention biases (attention_bias: true)"),
    ("qwen3_sliding", "sliding-window attention"),
    ("gemma", "model type 'gemma' is not one of the families here"),
    ("gelu_new", "activation_function 'gelu_new'"),
    ("head_dim", "head_dim 16 x 4 heads != hidden size 32"),
])
def test_what_cannot_be_represented_is_refused_by_name(case, message, tmp_path):
    import transformers

    configs = _tiny_models()
    config = {
        "llama3_rope": lambda: transformers.LlamaConfig(
            **{**configs["llama"].to_dict(), "rope_scaling": {
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        "attention_bias": lambda: transformers.LlamaConfig(
            **{**configs["llama"].to_dict(), "attention_bias": True}),
        "qwen3_sliding": lambda: transformers.Qwen3Config(
            **{**configs["qwen3"].to_dict(), "use_sliding_window": True, "sliding_window": 16,
               "layer_types": None}),
        "gemma": lambda: transformers.GemmaConfig(vocab_size=96, hidden_size=32,
                                                  num_hidden_layers=2, num_attention_heads=4,
                                                  intermediate_size=48, head_dim=8),
        "gelu_new": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96),
        "head_dim": lambda: transformers.LlamaConfig(**{**configs["llama"].to_dict(),
                                                        "head_dim": 16}),
    }[case]()
    save = tmp_path / "out"
    proc = _run(["tools/convert_from_hf.py", "--hf-model", _config_dir(tmp_path, config),
                 "--save", save], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("convert_from_hf: error: ") and message in last, last
    assert not save.exists()


def test_save_must_be_new_and_bad_references_are_named(tmp_path):
    held = tmp_path / "held"
    held.mkdir()
    (held / "keep.txt").write_text("data")
    proc = _run(["tools/convert_from_hf.py", "--hf-model", tmp_path, "--save", held], check=False)
    assert proc.returncode == 2 and "not an empty directory" in proc.stderr
    assert (held / "keep.txt").read_text() == "data"
    proc = _run(["tools/convert_from_hf.py", "--hf-model", tmp_path / "nowhere", "--save",
                 tmp_path / "x"], check=False)
    assert proc.returncode == 2 and "no such directory" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["held"]


def test_bfloat16_import_holds_the_rounded_weights(tmp_path):
    """--dtype bfloat16: the run config says --bf16 and the export gives each original
    tensor rounded to bf16 (torch's own rounding), nothing else."""
    from safetensors.torch import load_file

    hf_dir = _save_tiny("llama", tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", ckpt, "--dtype", "bfloat16"])
    assert "bf16: true" in (ckpt / "iter_0000000" / "run_config.yaml").read_text()
    _run(["tools/convert_to_hf.py", "--load", ckpt, "--output", tmp_path / "back"])
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor.to(torch.bfloat16).to(torch.float32)), key
    assert any(not torch.equal(back[k], t) for k, t in original.items())  # it did round


def test_weights_that_do_not_match_config_are_refused(tmp_path):
    """transformers fills what config.json asks for and the files lack with a random init;
    the import refuses it instead of converting random layers: the layer count config.json
    claims is compared with the safetensors header before any model is built."""
    hf_dir = _save_tiny("llama", tmp_path / "hf")
    config = json.load(open(os.path.join(hf_dir, "config.json")))
    config["num_hidden_layers"] = 5
    json.dump(config, open(os.path.join(hf_dir, "config.json"), "w"))
    proc = _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", tmp_path / "ck"],
                check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        f"convert_from_hf: error: {os.path.join(hf_dir, 'config.json')}: num_hidden_layers is "
        "5, but the weights hold layers 0-3 (4); correct it in that file")
    assert not (tmp_path / "ck").exists()


def test_sigterm_while_writing_leaves_nothing(smollm2_hf, tmp_path):
    import signal

    save = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, "tools/convert_from_hf.py", "--hf-model", smollm2_hf,
                             "--save", str(save)], cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:  # the weights are read; the save has begun
        if line.startswith("writing"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert f"convert_from_hf: stopped (SIGTERM); nothing written to {save}" in err
    assert os.listdir(tmp_path) == []  # neither --save nor the temporary directory
