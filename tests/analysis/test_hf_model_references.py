"""--hf-model as a directory, a hub id in the local Hugging Face cache, or a GGUF file, and
--device-map auto, for eval_jump and eval_downstream, against independent references.

- A tiny random Llama placed in a fake local hub cache (models--org--name/blobs, snapshots,
  refs/main; HF_HUB_OFFLINE=1) measures as its directory does, and the directory as HF's
  own ``output_hidden_states`` says.
- The real model: SmolLM2-135M-Instruct's GGUF file (dequantized by transformers) measures
  as the dequantized directory of the ``smollm2_hf`` fixture (1e-5 relative per layer), and
  shows the paper's jump (zeta_L > 3).
- ``--device-map auto --dtype float32`` (everything on the CPU here) equals the plain run,
  and so do layers that accelerate's hooks run (offloaded to disk); ``--device-map auto
  --dtype bfloat16`` is finite and near fp32.
- eval_downstream scores a GGUF file as its dequantized directory and a cached hub id as
  its directory, on local lm-eval tasks; the temporary directory is gone afterwards (also
  when the evaluation fails).
- A missing path, a file that is not .gguf, a hub id that is not cached: exit 2, one line.

Every model is loaded in a fresh process, started together at the module's start: an
earlier in-process ``--load`` in the same pytest worker leaves megatron_jreg.platform.cpu's
torch-factory redirections behind, under which transformers builds RoPE buffers from
uninitialized memory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from checkpoint_runs import REPO, run_env

from megatron_jreg.errors import InputError
from real_model import smollm2_gguf

pytest.importorskip("transformers")

HUB_ID = "jreg-tests/tiny-llama"
UNCACHED_ID = "jreg-tests/not-cached"
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
TMP_PREFIX = "eval_downstream."

# a few hundred tokens of plain English: enough for SmolLM2's jump to show, seconds to run
SMOL_TEXT = [
    "The history of science is the study of how people came to understand the natural world. "
    "Early astronomers watched the sky for years and wrote down where the planets moved, and "
    "their tables were used for centuries to predict eclipses and the seasons.",
    "A river is a natural stream of fresh water that flows towards an ocean, a lake or another "
    "river. Small rivers are called creeks or brooks. Rivers carry sand and stones downstream "
    "and slowly shape the valleys through which they run.",
    "Bread is made from flour, water, salt and yeast. The dough is kneaded, left to rise in a "
    "warm place, shaped into loaves and baked in a hot oven until the crust is brown and the "
    "inside is soft.",
    "When the train finally arrived, the station was crowded with families who had waited all "
    "afternoon. Children ran along the platform, and an old man with a suitcase asked the "
    "conductor whether this was the last train to the coast.",
]


def _env(root, **extra):
    env = run_env()
    for key in ("XDG_CACHE_HOME", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(key, None)
    env.update(HF_HOME=str(root / "hf_home"), HF_HUB_CACHE=str(root / "hub"),
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=REPO,
               TOKENIZERS_PARALLELISM="false", **extra)
    return env


class Job:
    """A process started now (``python tools/NAME.py ARGV``, or ``python -c SCRIPT ARGV``);
    :meth:`wait` asserts it succeeded. The module's processes run side by side: much of
    their time is single-threaded (imports, parsing the GGUF file), so they overlap."""

    def __init__(self, name, argv, env, logs, script=None):
        self.err_path = logs / f"{len(os.listdir(logs))}.{name}.err"
        command = ["-c", script] if script is not None else [f"tools/{name}.py"]
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, *command, *map(str, argv)],
                                         cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                                         stderr=err)
        self.stderr = None

    def wait(self):
        if self.stderr is None:
            try:
                rc = self.proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
            self.stderr = self.err_path.read_text()
            assert rc == 0, self.stderr[-4000:]
        return self


def write_hub_cache(model_dir, hub, repo_id, commit=SNAPSHOT):
    """``model_dir`` as huggingface_hub caches a download of ``repo_id``: the files as
    blobs named by their hash, the snapshot's entries relative symlinks to them, and
    refs/main naming the snapshot."""
    repo = os.path.join(str(hub), "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(snapshot)
    for name in sorted(os.listdir(model_dir)):
        data = open(os.path.join(model_dir, name), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(repo, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    return snapshot


@pytest.fixture(scope="module")
def root(tiny_hf_model, tmp_path_factory):
    """A tmp root with hub/ (the fake cache holding the tiny model as HUB_ID), an empty
    hf_home/, the SmolLM2 text and the local lm-eval tasks."""
    from downstream_tasks import write_tasks

    root = tmp_path_factory.mktemp("hf_refs")
    write_hub_cache(tiny_hf_model, root / "hub", HUB_ID)
    for name in ("hf_home", "logs", "tmp_plain", "tmp_device_map"):
        (root / name).mkdir()
    (root / "smol.txt").write_text("\n".join(SMOL_TEXT) + "\n")
    write_tasks(str(root / "tasks"), n=8)
    return root


def _downstream_args(root, key, models, extra=()):
    from downstream_tasks import CHOICE, LAMBADA

    return ["--hf-model", *models, "--tasks", f"{LAMBADA},{CHOICE}", "--include-path",
            root / "tasks", "--limit", "4", "--batch-size", "4", "--no-cache",
            "--json", root / f"ds_{key}.json", *extra]


# In a fresh process: the tool's numbers for the tiny model with two layers and the final
# norm offloaded to disk (accelerate's hooks load and run them, as they run the layers of a
# model spread over GPUs; on a CPU --device-map auto needs no hook at all) and without, and
# HF's own output_hidden_states (test_eval_jump_hf's independent reference).
HOOKS_SCRIPT = """
import json, sys, tempfile
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from megatron_jreg.analysis.hf_source import HFCausalLMSource
from megatron_jreg.analysis.jump_accumulator import JumpAccumulator
sys.path[:0] = ["tests", "tests/analysis"]
from test_eval_jump_hf import independent_displacement

path, out, documents = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(path)
ids = [tokenizer(doc)["input_ids"] for doc in documents]
width = max(map(len, ids))
batch = torch.tensor([row + [1] * (width - len(row)) for row in ids])
mask = torch.tensor([[i < len(row) for i in range(width)] for row in ids])
placement = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
             "model.layers.1": "disk", "model.layers.2": "disk", "model.norm": "disk",
             "lm_head": "cpu"}
result = {"independent": independent_displacement(path, documents, False)}
with tempfile.TemporaryDirectory() as offload:
    models = {"plain": AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
              "hooks": AutoModelForCausalLM.from_pretrained(
                  path, dtype=torch.float32, device_map=placement, offload_folder=offload)}
    result["hooked"] = hasattr(models["hooks"].model.layers[1], "_hf_hook")
    for final_norm in (False, True):
        for key, model in models.items():
            source = HFCausalLMSource(model, tokenizer, key, include_final_norm=final_norm)
            acc = JumpAccumulator(source.num_layers)
            source.accumulate(batch, mask, acc)
            result[f"{key}_{final_norm}"] = acc.displacement()
with open(out, "w") as f:
    json.dump(result, f)
"""


@pytest.fixture(scope="module", autouse=True)
def jobs(request, root, tiny_hf_model, eval_text, eval_documents):
    """Every model run of the module, each in its own process, started before the first
    test (the SmolLM2 ones once the fixture's directory exists); the tests wait for the
    ones they read."""
    logs, jobs, env = root / "logs", {}, _env(root)
    try:
        _start_jobs(jobs, request, root, env, logs, tiny_hf_model, eval_text, eval_documents)
        yield jobs
    finally:
        for job in jobs.values():  # a failed test or fixture leaves none running
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()


def _start_jobs(jobs, request, root, env, logs, tiny_hf_model, eval_text, eval_documents):
    jump = ["--text-file", eval_text, "--no-progress", "--json"]
    jobs["jump_hub"] = Job("eval_jump", ["--hf-model", tiny_hf_model, HUB_ID, *jump,
                                         root / "jump_hub.json"], env, logs)
    jobs["jump_map"] = Job("eval_jump", ["--hf-model", tiny_hf_model, HUB_ID, "--device-map",
                                         "auto", "--dtype", "float32", *jump,
                                         root / "jump_map.json"], env, logs)
    jobs["hooks"] = Job("hooks", [tiny_hf_model, root / "hooks.json",
                                  json.dumps(eval_documents)], env, logs, script=HOOKS_SCRIPT)
    have_lm_eval = importlib.util.find_spec("lm_eval") is not None
    if have_lm_eval:
        jobs["ds_device_map"] = Job("eval_downstream", _downstream_args(
            root, "device_map", [tiny_hf_model], ["--device-map", "auto"]),
            _env(root, TMPDIR=str(root / "tmp_device_map")), logs)
    smollm2_hf = request.getfixturevalue("smollm2_hf")  # built while those run
    smol = ["--text-file", root / "smol.txt", "--no-progress", "--json"]
    jobs["jump_smol"] = Job("eval_jump", ["--hf-model", smollm2_gguf(), smollm2_hf, *smol,
                                          root / "jump_smol.json"], env, logs)
    jobs["jump_bf16"] = Job("eval_jump", ["--hf-model", smollm2_hf, "--device-map", "auto",
                                          "--dtype", "bfloat16", *smol,
                                          root / "jump_bf16.json"], env, logs)
    if have_lm_eval:
        jobs["ds_plain"] = Job("eval_downstream", _downstream_args(
            root, "plain", [smollm2_gguf(), smollm2_hf, HUB_ID, tiny_hf_model],
            [arg for label in ("gguf", "dir", "hub", "tiny") for arg in ("--label", label)]),
            _env(root, TMPDIR=str(root / "tmp_plain")), logs)


def _reports(jobs, root, name):
    """The --json output of job ``name``, as a list of reports."""
    jobs[name].wait()
    data = json.loads((root / f"{name}.json").read_text())
    return data if isinstance(data, list) else [data]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


# ---- eval_jump: a cached hub id, --device-map ---------------------------------------------


def test_cached_hub_id_measures_as_its_directory(jobs, root, tiny_hf_model):
    directory, hub = _reports(jobs, root, "jump_hub")
    assert hub["model"] == "tiny-llama" and hub["source"] == HUB_ID
    assert os.path.realpath(hub["snapshot"]) == os.path.realpath(
        root / "hub" / "models--jreg-tests--tiny-llama" / "snapshots" / SNAPSHOT)
    assert directory["source"] == os.path.abspath(tiny_hf_model)
    assert hub["tokens"] == directory["tokens"] > 0
    assert hub["displacement"] == directory["displacement"]  # the same weights, bit for bit
    assert hub["jump_rate"] == directory["jump_rate"]


def test_directory_measures_as_hf_hidden_states(jobs, root):
    """The reference of the reference: HF's own hidden states, one document at a time."""
    directory = _reports(jobs, root, "jump_hub")[0]
    jobs["hooks"].wait()
    ref, tokens = json.loads((root / "hooks.json").read_text())["independent"]
    assert directory["tokens"] == tokens
    for got, want in zip(directory["displacement"], ref):
        assert _rel(got, want) <= 1e-6, (directory["displacement"], ref)


def test_device_map_auto_equals_the_plain_run(jobs, root):
    plain, mapped = _reports(jobs, root, "jump_hub"), _reports(jobs, root, "jump_map")
    for a, b in zip(plain, mapped):
        assert b["tokens"] == a["tokens"]
        for got, want in zip(b["displacement"], a["displacement"]):
            assert _rel(got, want) <= 1e-12, (b["displacement"], a["displacement"])


@pytest.mark.parametrize("include_final_norm", [False, True])
def test_layers_run_by_accelerate_hooks_measure_the_same(jobs, root, include_final_norm):
    jobs["hooks"].wait()
    result = json.loads((root / "hooks.json").read_text())
    assert result["hooked"]
    assert result[f"hooks_{include_final_norm}"] == result[f"plain_{include_final_norm}"]
    assert result["plain_True"][:-1] == result["plain_False"][:-1]  # the norm: h_L only
    assert result["plain_True"][-1] != result["plain_False"][-1]


# ---- eval_jump: the real model, GGUF and directory, fp32 and bf16 -------------------------


@pytest.fixture(scope="module")
def smol_runs(jobs, root):
    gguf, directory = _reports(jobs, root, "jump_smol")
    (bf16,) = _reports(jobs, root, "jump_bf16")
    return {"gguf": gguf, "dir": directory, "bf16": bf16}


def test_gguf_measures_as_its_dequantized_directory(smol_runs):
    gguf, directory = smol_runs["gguf"], smol_runs["dir"]
    assert gguf["model"] == "SmolLM2-135M-Instruct.Q4_1" and gguf["num_layers"] == 30
    assert gguf["source"] == os.path.abspath(smollm2_gguf())
    assert 150 <= gguf["tokens"] == directory["tokens"] <= 400
    for layer, (got, want) in enumerate(zip(gguf["displacement"], directory["displacement"]), 1):
        assert _rel(got, want) <= 1e-5, (layer, got, want)
    print(f"SmolLM2 zeta_L: GGUF {gguf['jump_rate']['L']:.4f}, "
          f"directory {directory['jump_rate']['L']:.4f}, tokens {gguf['tokens']}")


def test_real_model_shows_the_jump(smol_runs):
    """The paper's phenomenon: the last layer moves the state far more than the middle."""
    psi = smol_runs["dir"]["displacement"]
    assert smol_runs["gguf"]["jump_rate"]["L"] > 3 and smol_runs["dir"]["jump_rate"]["L"] > 3
    middle = sorted(psi[5:25])[10]
    assert psi[-1] > 3 * middle, psi


def test_bfloat16_with_device_map_is_near_fp32(smol_runs):
    fp32, bf16 = smol_runs["dir"], smol_runs["bf16"]
    assert bf16["tokens"] == fp32["tokens"]
    for layer, (got, want) in enumerate(zip(bf16["displacement"], fp32["displacement"]), 1):
        assert math.isfinite(got), (layer, bf16["displacement"])
        assert abs(got - want) <= 0.05 * want + 2e-3, (layer, got, want)
    assert abs(bf16["jump_rate"]["L"] - fp32["jump_rate"]["L"]) <= 0.1 * fp32["jump_rate"]["L"]


# ---- eval_downstream: GGUF and cached hub id ----------------------------------------------


@pytest.fixture(scope="module")
def downstream(jobs, root):
    pytest.importorskip("lm_eval")
    out = {}
    for key in ("plain", "device_map"):
        job = jobs[f"ds_{key}"].wait()
        reports = json.loads((root / f"ds_{key}.json").read_text())
        out[key] = {"reports": reports if isinstance(reports, list) else [reports],
                    "stderr": job.stderr, "tmp": root / f"tmp_{key}"}
    return out


def _same_scores(a, b):
    assert set(a["tasks"]) == set(b["tasks"])
    for task, score in a["tasks"].items():
        other = b["tasks"][task]
        assert score["samples"] == other["samples"] == 4
        assert score["lm_eval"] == other["lm_eval"], (task, score, other)
    assert a["average"] == b["average"]


def test_downstream_gguf_and_hub_id_score_as_their_directories(downstream, smollm2_hf,
                                                               tiny_hf_model):
    gguf, directory, hub, tiny = downstream["plain"]["reports"]
    assert [r["model"] for r in (gguf, directory, hub, tiny)] == ["gguf", "dir", "hub", "tiny"]
    assert gguf["source"] == smollm2_gguf() and directory["source"] == smollm2_hf
    assert hub["source"] == HUB_ID and tiny["source"] == tiny_hf_model
    _same_scores(gguf, directory)
    _same_scores(hub, tiny)
    assert any(s["lm_eval"].get("perplexity") for s in gguf["tasks"].values())
    assert "dequantizing" in downstream["plain"]["stderr"]


def test_downstream_device_map_auto_equals_the_plain_run(downstream):
    (mapped,) = downstream["device_map"]["reports"]
    _same_scores(mapped, downstream["plain"]["reports"][3])


def test_downstream_temporary_directories_are_removed(downstream):
    for key in ("plain", "device_map"):
        left = [n for n in os.listdir(downstream[key]["tmp"]) if n.startswith(TMP_PREFIX)]
        assert left == [], (key, left)
    assert not os.path.exists(os.path.join(REPO, "offload"))  # lm-eval's default folder


def test_downstream_temporary_directory_is_removed_on_error(tmp_path, monkeypatch):
    """The dequantized copy goes when lm-eval fails half-way."""
    import argparse
    import tempfile

    from megatron_jreg import hf_models
    from megatron_jreg.downstream import cache as cache_mod
    from megatron_jreg.downstream import evaluate as cli
    from megatron_jreg.downstream import harness

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = {}

    def dequantize(path, output, flag="--hf-model", dtype=None):
        os.makedirs(output)
        (open(os.path.join(output, "config.json"), "w")).write("{}")
        seen["dir"] = output
        return output

    def evaluate(model_dir, names, manager, **kwargs):
        assert model_dir == seen["dir"] and os.path.isdir(model_dir)
        raise RuntimeError("lm-eval failed")

    monkeypatch.setattr(hf_models, "dequantize_gguf", dequantize)
    monkeypatch.setattr(harness, "evaluate_hf", evaluate)
    entry = cli.ModelEntry("m", "hf_model", "m.gguf", local="/models/m.gguf")
    args = argparse.Namespace(num_fewshot=0, dtype="float32", device="cpu", batch_size="4",
                              device_map=None)
    with pytest.raises(RuntimeError, match="lm-eval failed"):
        cli.evaluate_model(entry, ["t"], {"t": "d"}, None, cache_mod.ResultCache(None), args,
                           None)
    assert seen["dir"].startswith(str(tmp_path)) and os.listdir(tmp_path) == []


# ---- bad references ----------------------------------------------------------------------


@pytest.fixture
def empty_hub(tmp_path, monkeypatch):
    """No model in the local hub cache, and no network."""
    from huggingface_hub import constants

    hub = tmp_path / "empty_hub"
    hub.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


def _bad_references(tmp_path):
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    return [
        (tmp_path / "missing-model", "no such directory; check the path"),
        (tmp_path / "missing.gguf", "no such file; check the path"),
        (not_gguf, "a file that is not .gguf; give a model directory"),
        (UNCACHED_ID, f"`hf download {UNCACHED_ID}`"),
    ]


def _one_line_error(capsys, main, argv, prog):
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as err:
        rc = err.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: "), repr(err)
    return err


def test_bad_references_eval_jump(capsys, tmp_path, empty_hub):
    from megatron_jreg import hf_models
    from megatron_jreg.commands.eval_jump import main

    text = tmp_path / "t.txt"
    text.write_text("w1 w2\n")
    for reference, fix in _bad_references(tmp_path):
        err = _one_line_error(capsys, main, ["--hf-model", reference, "--text-file", text,
                                             "--no-progress"], "eval_jump")
        assert f"--hf-model {reference}: " in err and fix in err, err
    err = _one_line_error(capsys, main, ["--load", tmp_path, "--device-map", "auto",
                                         "--text-file", text], "eval_jump")
    assert "--device-map auto applies to --hf-model only" in err
    with pytest.raises(InputError, match="drop --device"):
        hf_models.check_device_map("auto", "cuda")


def test_bad_references_eval_downstream(capsys, tmp_path, empty_hub):
    pytest.importorskip("lm_eval")
    from megatron_jreg.commands.eval_downstream import main

    for reference, fix in _bad_references(tmp_path):
        err = _one_line_error(capsys, main, ["--hf-model", reference, "--tasks", "boolq",
                                             "--no-cache"], "eval_downstream")
        assert f"--hf-model {reference}: " in err and fix in err, err

