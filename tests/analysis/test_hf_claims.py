"""What a Hugging Face model's config claims is compared with the shapes its weight files
list before any model is built or any tensor read (issue 46, item 3).

- The attack: config.json claims ``num_hidden_layers: 1000000`` beside the weights of 6
  layers. The old convert_from_hf was still "reading" after 200 s at 3.1 GB and growing;
  now convert_from_hf and eval_jump --hf-model end in one line within seconds, run in a
  subprocess under a 3 GB address-space cap and a timeout, so a regression fails rather
  than eating the machine (under 20 CPU seconds, nearly all of it imports).
- Each architecture field (layers, hidden size, heads, key/value heads, head_dim, FFN,
  vocabulary) that the safetensors header contradicts is one line naming the field, its
  value and the tensor that says otherwise; the references are the tensors' shapes as
  written by transformers' save_pretrained, which the test reads back with safetensors.
- The same through a sharded ``model.safetensors.index.json``, a ``pytorch_model.bin``
  (listed on the meta device, no storage read) and a GGUF file (written here with gguf's
  GGUFWriter; block_count claimed against the blk.N tensors).
- A string, a bool, zero, a negative number, NaN: one line ``<file>: <field> is <value>,
  not an integer >= 1``. An absurd size with no weight file to compare: refused by bound.
- No false refusal: tiny models of every layout eval_jump reads (saved by transformers),
  Gemma 3's multimodal config (text_config) and the real SmolLM2 GGUF pass.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch

import megatron_jreg
from megatron_jreg.errors import InputError
from megatron_jreg.hf_models import resolve_hf_model

transformers = pytest.importorskip("transformers")

# the tree whose code is under test (a copy of this file may test another checkout)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(megatron_jreg.__file__)))
MEMORY_CAP = 3 * 1024 ** 3


def _llama_config(**changes):
    values = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaConfig(**{**values, **changes})


def _save(config, directory, tokenizer=False, **kwargs):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory, **kwargs)
    if tokenizer:
        from tiny_tokenizer import save_tokenizer

        save_tokenizer(str(directory))
    return str(directory)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """A 6-layer Llama directory with a tokenizer, as save_pretrained writes it."""
    return _save(_llama_config(), tmp_path_factory.mktemp("hf") / "six", tokenizer=True)


def _claiming(source, target, **changes):
    """A copy of model directory ``source`` whose config.json says ``changes``."""
    shutil.copytree(source, target)
    path = os.path.join(target, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(changes)
    with open(path, "w") as f:
        json.dump(config, f)  # NaN is written as NaN, which json (and transformers) read
    return str(target), path


def _shapes(directory):
    from safetensors import safe_open

    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}


def _capped(argv, timeout=90):
    """``python ARGV`` in ROOT under a 3 GB address-space cap; (proc, CPU seconds it
    took). CPU time, not wall time: on a shared CI machine the imports alone can take
    half a minute of wall time, while the old build of the claimed model took all the
    CPU it was given until the timeout."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))

    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout, preexec_fn=cap)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


# ---- the attack: a million layers claimed, six held ------------------------------------------


def test_a_million_layers_claimed_is_one_line_from_convert_from_hf(six_layers, tmp_path):
    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", num_hidden_layers=1000000)
    try:
        proc, seconds = _capped(["tools/convert_from_hf.py", "--hf-model", hf_dir,
                                 "--save", tmp_path / "ck"])
    except subprocess.TimeoutExpired:
        pytest.fail("convert_from_hf built the claimed model for 90 s instead of refusing it")
    print(f"refused after {seconds:.1f} CPU seconds")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"convert_from_hf: error: {config_file}: num_hidden_layers is 1000000, but the weights "
        "hold layers 0-5 (6); correct it in that file"]
    assert "reading" not in proc.stdout  # no weight was read
    assert seconds < 20 and sorted(os.listdir(tmp_path)) == ["hf"]


def test_a_million_layers_claimed_is_one_line_from_eval_jump(six_layers, tmp_path):
    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", num_hidden_layers=1000000)
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat\n")
    try:
        proc, seconds = _capped(["tools/eval_jump.py", "--hf-model", hf_dir, "--text-file", text,
                                 "--no-progress"])
    except subprocess.TimeoutExpired:
        pytest.fail("eval_jump built the claimed model for 90 s instead of refusing it")
    print(f"refused after {seconds:.1f} CPU seconds")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        f"{config_file}: num_hidden_layers is 1000000, but the weights hold layers 0-5 (6); "
        "correct it in that file"), lines
    assert seconds < 20


# ---- each field against the safetensors header -------------------------------------------------


def _field_cases():
    # (field, claimed value, the message after "<config.json>: <field> is <value>, ")
    return [
        ("num_hidden_layers", 7, "but the weights hold layers 0-5 (6)"),
        ("num_hidden_layers", 5, "but the weights hold layers 0-5 (6)"),
        ("vocab_size", 10 ** 7, "but the weights hold 96 embedding rows "
         "(model.embed_tokens.weight is [96, 32])"),
        ("hidden_size", 4096, "but the weights hold 32 as the hidden size "
         "(model.layers.0.input_layernorm.weight is [32])"),
        ("intermediate_size", 10 ** 6, "but the weights hold 48 as the FFN size "
         "(model.layers.0.mlp.gate_proj.weight is [48, 32])"),
        ("num_attention_heads", 400, "but the weights hold 32 query rows "
         "(model.layers.0.self_attn.q_proj.weight is [32, 32])"),
        ("num_key_value_heads", 4, "but the weights hold 16 key rows "
         "(model.layers.0.self_attn.k_proj.weight is [16, 32])"),
        ("head_dim", 10 ** 6, "but the weights hold 32 query rows "
         "(model.layers.0.self_attn.q_proj.weight is [32, 32])"),
    ]


@pytest.mark.parametrize("field,value,message", _field_cases(),
                         ids=[f"{c[0]}={c[1]}" for c in _field_cases()])
def test_each_field_is_compared_with_the_safetensors_header(field, value, message, six_layers,
                                                           tmp_path):
    shapes = _shapes(six_layers)  # the reference: what save_pretrained wrote
    assert shapes["model.embed_tokens.weight"] == [96, 32]
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == [48, 32]
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == [32, 32]
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == [16, 32]
    assert {int(n.split(".")[2]) for n in shapes if n.startswith("model.layers.")} == set(range(6))
    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", **{field: value})
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    # heads and key/value heads are held to rows of heads x head_dim (8 in config.json):
    # which of the two factors is wrong, the weights cannot tell, so both are named
    claimed = {"num_attention_heads": f"num_attention_heads x head_dim is {value} x 8",
               "num_key_value_heads": f"num_key_value_heads x head_dim is {value} x 8",
               "head_dim": f"num_attention_heads x head_dim is 4 x {value}"}
    assert str(err.value) == (f"{config_file}: {claimed.get(field, f'{field} is {value}')}, "
                              f"{message}; correct it in that file")


@pytest.mark.parametrize("value,shown", [
    ("6", "'6'"), (True, "True"), (0, "0"), (-6, "-6"), (math.nan, "nan"), (6.0, "6.0"),
    ([6], "[6]")])
def test_a_layer_count_that_is_not_a_count_is_named(value, shown, six_layers, tmp_path):
    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", num_hidden_layers=value)
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    assert str(err.value) == (f"{config_file}: num_hidden_layers is {shown}, not an integer "
                              ">= 1; correct it in that file")


def test_an_absurd_size_without_weights_to_compare_is_refused(six_layers, tmp_path):
    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", num_hidden_layers=1000000)
    os.remove(os.path.join(hf_dir, "model.safetensors"))
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    assert str(err.value) == (f"{config_file}: num_hidden_layers is 1000000, not an integer "
                              "from 1 to 4096 (no model has more, and no weight file is here "
                              "to say otherwise); correct it in that file")


def test_an_unreadable_config_is_one_line_naming_the_flag(six_layers, tmp_path):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(six_layers, hf_dir)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(InputError, match=r"^--hf-model .*: cannot load .*config\.json"):
        resolve_hf_model(hf_dir)


# ---- the other weight formats ------------------------------------------------------------


def test_a_sharded_index_is_compared_shard_by_shard(tmp_path):
    hf_dir = _save(_llama_config(), tmp_path / "sharded", max_shard_size="20KB")
    index = json.load(open(os.path.join(hf_dir, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 2  # the layers are spread over shards
    assert resolve_hf_model(hf_dir) == hf_dir
    config_file = os.path.join(hf_dir, "config.json")
    config = json.load(open(config_file))
    json.dump({**config, "num_hidden_layers": 1000000}, open(config_file, "w"))
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    assert str(err.value) == (f"{config_file}: num_hidden_layers is 1000000, but the weights "
                              "hold layers 0-5 (6); correct it in that file")
    # a shard the index names that is not there, or that is outside the directory
    json.dump(config, open(config_file, "w"))
    shard = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(hf_dir, shard))
    with pytest.raises(InputError, match=f"names shard {shard}, which is not in "):
        resolve_hf_model(hf_dir)
    index["weight_map"] = {k: "../elsewhere.safetensors" for k in index["weight_map"]}
    json.dump(index, open(os.path.join(hf_dir, "model.safetensors.index.json"), "w"))
    with pytest.raises(InputError, match="which is not a file name in the model's directory"):
        resolve_hf_model(hf_dir)


def test_a_pytorch_bin_is_listed_without_reading_its_storages(six_layers, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    hf_dir, config_file = _claiming(six_layers, tmp_path / "hf", num_hidden_layers=1000000)
    weights = os.path.join(hf_dir, "model.safetensors")
    torch.save(load_file(weights), os.path.join(hf_dir, "pytorch_model.bin"))
    os.remove(weights)
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    assert str(err.value) == (f"{config_file}: num_hidden_layers is 1000000, but the weights "
                              "hold layers 0-5 (6); correct it in that file")


def test_a_damaged_safetensors_header_is_one_line(six_layers, tmp_path):
    hf_dir = str(tmp_path / "hf")
    shutil.copytree(six_layers, hf_dir)
    weights = os.path.join(hf_dir, "model.safetensors")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.write((2 ** 62).to_bytes(8, "little"))  # a header "longer" than the file
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    assert str(err.value) == (f"{weights}: its header claims {2 ** 62} bytes, the file holds "
                              f"{size - 8} after the length; the weight file is damaged or not "
                              "what its name says, replace it")


def _llama_gguf(path, block_count, blocks=2):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(24)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_vocab_size(64)
    # GGUF lists the innermost dimension first: numpy's [rows, cols] is written as it is
    writer.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    for i in range(blocks):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(16, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", np.ones((16, 16), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_k.weight", np.ones((16, 16), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", np.ones((24, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_a_gguf_block_count_is_compared_with_its_blocks(tmp_path):
    pytest.importorskip("gguf")
    honest = _llama_gguf(tmp_path / "honest.gguf", 2)
    assert resolve_hf_model(honest) == honest
    bomb = _llama_gguf(tmp_path / "bomb.gguf", 1000000)
    with pytest.raises(InputError) as err:
        resolve_hf_model(bomb)
    assert str(err.value) == (f"{bomb}: llama.block_count is 1000000, but the weights hold "
                              "layers 0-1 (2); correct it in that file")


# ---- no false refusal ----------------------------------------------------------------------


def _layouts():
    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                 vocab_size=100)
    layouts = {
        "qwen3": lambda: transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **small),
        "mixtral": lambda: transformers.MixtralConfig(num_key_value_heads=2, num_local_experts=2,
                                                      **small),
        "gemma": lambda: transformers.GemmaConfig(num_key_value_heads=2, head_dim=8, **small),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(**small),
        "opt": lambda: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                                              num_attention_heads=4, vocab_size=100,
                                              word_embed_proj_dim=16),
        "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=100),
    }
    if hasattr(transformers, "Gemma3ForConditionalGeneration"):
        layouts["gemma3"] = lambda: transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=8,
                                                      **small).to_dict(),
            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, image_size=28, patch_size=14),
            mm_tokens_per_image=4)
    return layouts


@pytest.mark.parametrize("layout", sorted(_layouts()))
def test_every_layout_read_here_passes_and_its_layers_are_compared(layout, tmp_path):
    config = _layouts()[layout]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if layout == "gemma3":  # the multimodal model, whose decoder is text_config's
        model = transformers.Gemma3ForConditionalGeneration(config)
    hf_dir = str(tmp_path / layout)
    model.save_pretrained(hf_dir)
    assert resolve_hf_model(hf_dir) == hf_dir
    config_file = os.path.join(hf_dir, "config.json")
    saved = json.load(open(config_file))
    nest = "text_config" if layout == "gemma3" else None
    body = saved[nest] if nest else saved
    field = next(n for n in ("num_hidden_layers", "n_layer") if n in body)
    body[field] = 1000
    json.dump(saved, open(config_file, "w"))
    with pytest.raises(InputError) as err:
        resolve_hf_model(hf_dir)
    shown = f"{nest}.{field}" if nest else field
    assert str(err.value).startswith(f"{config_file}: {shown} is 1000, but the weights hold "
                                     "layers 0-2 (3)"), str(err.value)


def test_the_real_smollm2_gguf_passes_its_header_check():
    from real_model import smollm2_gguf

    try:
        path = smollm2_gguf()
    except Exception as err:  # the real model's package is not installed here
        pytest.skip(str(err))
    assert resolve_hf_model(path) == path
