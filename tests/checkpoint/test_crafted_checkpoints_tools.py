"""A checkpoint runs no code in the tools that read one: ``eval_jump --load``,
``convert_to_hf --load`` and ``eval_downstream --load`` refuse a checkpoint with a crafted
pickle (tests/crafted_checkpoints.py: it runs ``touch MARKER``, then loads as the genuine
file; the manifest matches) in one line naming the file and the import, exit 2, no marker,
no output. Crafted: ``.metadata``, ``common.pt`` (under ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``,
with which megatron-core's own load of it runs code) and a layer's extra state, a sharded
object every model load reads from the shards."""

import shutil

import pytest
from checkpoint_runs import ITERS, REPO, run_env

import crafted_checkpoints as crafted
import forked_trainer
from megatron_jreg.checkpoint.dist_checkpoint import iteration_dir

transformers = pytest.importorskip("transformers")

CRAFT = {
    "metadata": crafted.craft_metadata,
    "common": crafted.craft_common,
    "extra_state": lambda path, marker: crafted.craft_byte_entry(
        path, "decoder.layers.mlp.linear_fc1._extra_state", marker),
}


def crafted_copy(checkpoint, tmp_path, kind):
    root = tmp_path / "ckpt"
    shutil.copytree(checkpoint, root)
    marker = tmp_path / "MARKER"
    return root, CRAFT[kind](iteration_dir(str(root), ITERS), marker), marker


def run_tool(tmp_path, script, argv, kind):
    env = dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
               HF_HOME=str(tmp_path / "hf_home"), TOKENIZERS_PARALLELISM="false")
    if kind == "common":
        env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    return forked_trainer.run_tool(f"tools/{script}", [str(a) for a in argv], env, timeout=600)


def refused(proc, marker, file, tool):
    assert not marker.exists(), "the crafted pickle ran its command"
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    if tool == "eval_downstream":  # its progress lines (the tasks are loaded first) come before
        lines = lines[-1:]
    assert len(lines) == 1 and lines[0].startswith(f"{tool}: error: "), proc.stderr[-3000:]
    assert f"{file}: refused to load: unpickling it would import os.system" in lines[0], lines
    assert "could run code" in lines[0] and "rebuild the checkpoint" in lines[0], lines


@pytest.mark.parametrize("kind", list(CRAFT))
def test_eval_jump_runs_nothing_from_a_crafted_checkpoint(checkpoint, tmp_path, kind):
    root, file, marker = crafted_copy(checkpoint, tmp_path, kind)
    text = tmp_path / "eval.txt"
    text.write_text("the jump of the last layer\nresidual state of a token norm\n")
    proc = run_tool(tmp_path, "eval_jump.py", ["--load", root, "--text-file", text,
                                               "--json", tmp_path / "jump.json",
                                               "--no-progress"], kind)
    refused(proc, marker, file, "eval_jump")
    assert not (tmp_path / "jump.json").exists()


@pytest.mark.parametrize("kind", list(CRAFT))
def test_convert_to_hf_runs_nothing_from_a_crafted_checkpoint(checkpoint, tmp_path, kind):
    root, file, marker = crafted_copy(checkpoint, tmp_path, kind)
    proc = run_tool(tmp_path, "convert_to_hf.py", ["--load", root, "--output", tmp_path / "hf"],
                    kind)
    refused(proc, marker, file, "convert_to_hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("kind", ["metadata", "common"])
def test_eval_downstream_runs_nothing_from_a_crafted_checkpoint(checkpoint, tmp_path, kind):
    pytest.importorskip("lm_eval")
    from downstream_tasks import LAMBADA, write_tasks

    root, file, marker = crafted_copy(checkpoint, tmp_path, kind)
    tasks = write_tasks(str(tmp_path / "tasks"))
    proc = run_tool(tmp_path, "eval_downstream.py",
                    ["--load", root, "--tasks", LAMBADA, "--include-path", tasks, "--no-cache",
                     "--json", tmp_path / "scores.json"], kind)
    refused(proc, marker, file, "eval_downstream")
    assert not (tmp_path / "scores.json").exists()
