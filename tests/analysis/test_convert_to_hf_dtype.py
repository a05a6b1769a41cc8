"""convert_to_hf --dtype: the saved weights are the checkpoint's fp32 weights rounded to it.

The reference reads the checkpoint's files with torch.distributed.checkpoint itself (one
process, no process group), not through the trainer's loader, and maps the names to
Llama's by the layout megatron-core saves: per-layer tensors stacked on a leading layer
axis, the fused QKV rows grouped per key/value group as [q heads of g; k_g; v_g], fc1 as
[gate; up], and the norms under their fused linear layers.
"""

import json
import os
import sys
import warnings

import pytest
import torch
from checkpoint_runs import ITERS, run

pytest.importorskip("transformers")

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

EXPORT = """
import sys
from megatron_jreg.commands.convert_to_hf import main
load, pairs = sys.argv[1], sys.argv[2:]
for output, dtype in zip(pairs[::2], pairs[1::2]):
    assert main(["--load", load, "--output", output, "--dtype", dtype, "--no-tokenizer"]) == 0
"""


def checkpoint_weights(iteration_dir):
    """The model tensors of a saved iteration, as stored (the optimizer's left out)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(iteration_dir)
    meta = reader.read_metadata().state_dict_metadata
    state = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in meta.items()
             if isinstance(m, TensorStorageMetadata) and not key.startswith("optimizer.")}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        load(state, storage_reader=reader, no_dist=True)
    return state


def llama_names(state, config):
    """``state`` under LlamaForCausalLM's names."""
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    per = heads // groups
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"],
           "model.norm.weight": state["decoder.final_layernorm.weight"],
           "lm_head.weight": state["output_layer.weight"]}
    layer = {name[len("decoder.layers."):]: t for name, t in state.items()
             if name.startswith("decoder.layers.")}
    for i in range(config["num_hidden_layers"]):
        hf = f"model.layers.{i}."
        qkv = layer["self_attention.linear_qkv.weight"][i]
        d = qkv.shape[0] // (heads + 2 * groups)
        blocks = qkv.view(groups, (per + 2) * d, qkv.shape[1])
        gate, up = layer["mlp.linear_fc1.weight"][i].chunk(2)
        q, k, v = blocks.split([per * d, d, d], dim=1)
        out.update({
            hf + "self_attn.q_proj.weight": q.reshape(heads * d, -1),
            hf + "self_attn.k_proj.weight": k.reshape(groups * d, -1),
            hf + "self_attn.v_proj.weight": v.reshape(groups * d, -1),
            hf + "self_attn.o_proj.weight": layer["self_attention.linear_proj.weight"][i],
            hf + "mlp.gate_proj.weight": gate,
            hf + "mlp.up_proj.weight": up,
            hf + "mlp.down_proj.weight": layer["mlp.linear_fc2.weight"][i],
            hf + "input_layernorm.weight": layer["self_attention.linear_qkv.layer_norm_weight"][i],
            hf + "post_attention_layernorm.weight": layer["mlp.linear_fc1.layer_norm_weight"][i],
        })
    return out


@pytest.fixture(scope="module")
def exports(trained_checkpoints, tmp_path_factory):
    """The tp1 run's last iteration exported once per dtype: {dtype: directory}."""
    root = tmp_path_factory.mktemp("hf_dtype")
    outputs = {dtype: str(root / dtype) for dtype in DTYPES}
    run([sys.executable, "-c", EXPORT, trained_checkpoints["tp1"],
         *[x for pair in outputs.items() for x in pair[::-1]]])
    return outputs


@pytest.fixture(scope="module")
def trained_weights(trained_checkpoints):
    return checkpoint_weights(os.path.join(trained_checkpoints["tp1"], f"iter_{ITERS:07d}"))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_saved_weights_are_the_checkpoint_rounded_to_dtype(exports, trained_weights, dtype):
    from safetensors.torch import load_file

    directory = exports[dtype]
    config = json.load(open(os.path.join(directory, "config.json")))
    assert config.get("dtype", config.get("torch_dtype")) == dtype
    saved = load_file(os.path.join(directory, "model.safetensors"))
    assert {t.dtype for t in trained_weights.values()} == {torch.float32}  # trained in fp32
    expected = llama_names(trained_weights, config)
    assert sorted(saved) == sorted(expected)
    for name, weight in expected.items():
        assert saved[name].dtype == DTYPES[dtype], name
        assert torch.equal(saved[name], weight.to(DTYPES[dtype])), name  # torch's rounding
    # the rounding did something: no tensor of the trained model is exact in 16 bits
    assert all(not torch.equal(saved[n].float(), w) for n, w in expected.items())
