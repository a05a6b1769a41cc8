"""convert_from_hf refuses what it cannot import before the work, and names the cause.

- A GGUF file of an architecture no family here has (a tiny ``gemma3`` file written with
  gguf's GGUFWriter) is refused from its header in one line, in seconds: no weight is read
  and nothing is dequantized (the old import dequantized the whole file first: 70 s for
  3.4 GB). SmolLM2's GGUF (``llama``) passes the same check without a weight read.
- A config.json value of the wrong kind (a string, a count below 1, NaN, a string for a
  switch) is one line naming the field, the value and the file, before any weight is read
  (the old import gave a traceback or a message about our flags).
- Weights with NaN are refused naming the model and the tensor, with no advice about
  training (the old import named a vanished temporary directory and said "Lower --lr").
- ``--save`` a symlink to an empty (or a missing) directory is written through: the
  checkpoint lands in the target and reads back through the link (the old import failed
  after the whole conversion with "another process wrote there"). The other refusals of
  --save come before any weight is read.
"""

import json
import math
import os
import time

import pytest
import torch
from test_convert_from_hf import _run, _save_tiny

GEMMA3_ERROR = ("--hf-model {path}: a GGUF file of architecture 'gemma3' (general.architecture), "
                "not one of the families here (Llama, Qwen3, Mixtral, GPT-2; docs/families.md): "
                "it cannot be converted")


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Any weight read, or any GGUF dequantization, fails the test."""
    import gguf

    from megatron_jreg.checkpoint import from_hf

    def forbidden(*args, **kwargs):
        raise AssertionError("the weights were read before the refusal")

    monkeypatch.setattr(from_hf, "load_causal_lm", forbidden)
    monkeypatch.setattr(gguf, "dequantize", forbidden)
    return from_hf


def _gemma3_gguf(path):
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "gemma3")
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.ones((64, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_of_another_family_is_refused_from_its_header(tmp_path, no_weight_reads):
    from megatron_jreg.errors import InputError

    gguf_file = _gemma3_gguf(tmp_path / "tiny-gemma3.gguf")
    start = time.monotonic()
    with pytest.raises(InputError) as err:
        no_weight_reads.convert(gguf_file, str(tmp_path / "ck"), progress=lambda line: None)
    seconds = time.monotonic() - start
    print(f"refused in {seconds:.3f}s")
    assert seconds < 2
    assert str(err.value) == GEMMA3_ERROR.format(path=gguf_file)
    assert sorted(os.listdir(tmp_path)) == ["tiny-gemma3.gguf"]

    proc = _run(["tools/convert_from_hf.py", "--hf-model", gguf_file, "--save", tmp_path / "ck"],
                check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "convert_from_hf: error: " + GEMMA3_ERROR.format(path=gguf_file)]
    assert "reading" not in proc.stdout  # the weights were never reached
    assert sorted(os.listdir(tmp_path)) == ["tiny-gemma3.gguf"]


def test_a_gguf_of_a_family_passes_the_header_check_without_weights(no_weight_reads):
    from megatron_jreg.hf_models import smollm2_gguf

    try:
        path = smollm2_gguf()
    except Exception as err:  # the real model's package is not installed here
        pytest.skip(str(err))
    start = time.monotonic()
    config = no_weight_reads.config_before_weights(path, path)
    values = no_weight_reads.model_values(config)
    print(f"SmolLM2 GGUF metadata read in {time.monotonic() - start:.2f}s")
    assert values["num_layers"] == 30 and values["num_query_groups"] == 3


# ---- config.json values -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return _save_tiny("llama", tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    return _save_tiny("gpt2", tmp_path_factory.mktemp("hf") / "gpt2")


def _copy_with(source, target, drop=(), **changes):
    import shutil

    shutil.copytree(source, target)
    path = os.path.join(target, "config.json")
    config = json.load(open(path))
    for key in drop:
        del config[key]
    for key, value in changes.items():
        if "." in key:  # one level of nesting: rope_parameters.rope_theta
            outer, inner = key.split(".")
            config.setdefault(outer, {})[inner] = value
        else:
            config[key] = value
    with open(path, "w") as f:
        json.dump(config, f)  # NaN is written as NaN, which json (and transformers) read
    return str(target), path


@pytest.mark.parametrize("family,field,value,shown,expected", [
    ("llama", "rope_theta", "abc", "'abc'", "a finite number > 0"),
    ("llama", "rope_parameters.rope_theta", "abc", "'abc'", "a finite number > 0"),
    ("llama", "num_hidden_layers", -1, "-1", "an integer >= 1"),
    ("llama", "num_hidden_layers", 0, "0", "an integer >= 1"),
    ("llama", "hidden_size", "32", "'32'", "an integer >= 1"),
    ("llama", "intermediate_size", 2.5, "2.5", "an integer >= 1"),
    ("llama", "num_attention_heads", 0, "0", "an integer >= 1"),
    ("llama", "rms_norm_eps", math.nan, "nan", "a finite number > 0"),
    ("llama", "vocab_size", None, "null", "a value, not null"),
    ("llama", "tie_word_embeddings", "false", "'false'", "true or false"),
    ("gpt2", "n_layer", 0, "0", "an integer >= 1"),
    ("gpt2", "layer_norm_epsilon", math.inf, "inf", "a finite number > 0"),
])
def test_a_config_value_of_the_wrong_kind_is_named(family, field, value, shown, expected,
                                                   tiny_llama, tiny_gpt2, tmp_path,
                                                   no_weight_reads):
    from megatron_jreg.errors import InputError

    source = {"llama": tiny_llama, "gpt2": tiny_gpt2}[family]
    hf_dir, config_file = _copy_with(source, tmp_path / "hf", **{field: value})
    with pytest.raises(InputError) as err:
        no_weight_reads.convert(hf_dir, str(tmp_path / "ck"), progress=lambda line: None)
    assert str(err.value) == (f"{config_file}: {field} is {shown}, not {expected}; correct it "
                              "in that file")
    assert not (tmp_path / "ck").exists()


def test_a_wrong_config_value_is_one_line_from_the_tool(tiny_llama, tmp_path):
    # the base where configs before transformers 5 keep it (the old import: a traceback)
    hf_dir, config_file = _copy_with(tiny_llama, tmp_path / "hf", drop=["rope_parameters"],
                                     rope_theta="abc")
    proc = _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", tmp_path / "ck"],
                check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"convert_from_hf: error: {config_file}: rope_theta is 'abc', not a finite number > 0; "
        "correct it in that file"]


# ---- weights ----------------------------------------------------------------------------------


def test_weights_with_nan_are_refused_naming_the_tensor(tiny_llama, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    hf_dir = str(tmp_path / "hf")
    shutil.copytree(tiny_llama, hf_dir)
    weights = os.path.join(hf_dir, "model.safetensors")
    state = load_file(weights)
    name = "model.layers.1.mlp.down_proj.weight"
    state[name][0, :3] = torch.tensor([math.nan, math.inf, math.nan])
    save_file(state, weights, metadata={"format": "pt"})
    proc = _run(["tools/convert_from_hf.py", "--hf-model", hf_dir, "--save", tmp_path / "ck"],
                check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (f"convert_from_hf: error: --hf-model {hf_dir}: the model's weights are not "
                    f"finite: {name} holds 3 NaN or infinite values; the files are damaged or "
                    "come from a diverged run, so it is not converted")
    assert "--lr" not in proc.stderr and "writing" not in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["hf"]


# ---- --save -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target_exists", [True, False], ids=["empty_dir", "missing_dir"])
def test_save_through_a_symlink_writes_into_its_target(target_exists, tiny_llama, tmp_path):
    target = tmp_path / "disk" / "ckpt"
    if target_exists:
        target.mkdir(parents=True)
    else:
        (tmp_path / "disk").mkdir()
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    proc = _run(["tools/convert_from_hf.py", "--hf-model", tiny_llama, "--save", link],
                check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"wrote {link}:" in proc.stdout
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert (target / "iter_0000000" / "run_config.yaml").is_file()
    assert sorted(os.listdir(tmp_path / "disk")) == ["ckpt"]  # no temporary or lock left
    assert sorted(os.listdir(tmp_path)) == ["disk", "link"]
    from megatron_jreg.checkpoint.manifest import MANIFEST, verify_manifest

    assert (link / "iter_0000000" / MANIFEST).is_file()  # read back through the link
    assert verify_manifest(str(link / "iter_0000000")) is None


def test_other_save_refusals_come_before_any_weight(tiny_llama, tmp_path, no_weight_reads):
    from megatron_jreg.errors import InputError

    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("data")
    a_file = tmp_path / "file"
    a_file.write_text("data")
    link_to_full = tmp_path / "link"
    link_to_full.symlink_to(full)
    cases = [(full, "already exists and is not an empty directory"),
             (a_file, "already exists and is not an empty directory"),
             (link_to_full, "already exists and is not an empty directory"),
             (a_file / "ck", "cannot create directory")]
    for save, message in cases:
        with pytest.raises(InputError, match=message):
            no_weight_reads.convert(tiny_llama, str(save), progress=lambda line: None)
    assert (full / "keep.txt").read_text() == "data" and a_file.read_text() == "data"
    assert sorted(os.listdir(tmp_path)) == ["file", "full", "link"]
