"""JREG under every parallel layout equals the single-rank run of the same weights and batch.

Three jobs run once per session: the single-rank reference (which also saves the weights
every layout loads, and runs with recompute on), one 2-rank gloo job that runs each 2-rank
layout in turn, and one 4-rank job for the combined layouts (tests/model/layout_worker.py).
Each test compares one layout: the LM loss, every Psi_l, R, and gradients of parameters on
the first and the last layer.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

WORKER = os.path.join(os.path.dirname(__file__), "layout_worker.py")

# name -> ParallelConfig fields (and lambda) for the 2-rank job
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "vpp2": {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
    "dp2": {},
    "tp2_sp_full_recompute": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                              "recompute_granularity": "full"},
    # recompute runs in backward, after later micro-batches' forwards: the penalty must
    # use the recomputed micro-batch's token mask
    "pp2_full_recompute": {"pipeline_model_parallel_size": 2, "recompute_granularity": "full"},
    "pp2_selective_recompute": {"pipeline_model_parallel_size": 2,
                                "recompute_granularity": "selective",
                                "recompute_modules": ["core_attn", "mlp", "layernorm"]},
    # context parallelism: each rank holds 2 of 4 chunks of every sequence
    "cp2": {"context_parallel_size": 2},
    "cp2_full_recompute": {"context_parallel_size": 2, "recompute_granularity": "full"},
}
# 4 ranks: combined layouts (the data-parallel size is what is left, 2 where TP x PP = 2)
FOUR_RANK = {
    "4r_tp2_pp2": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "4r_tp2_sp_dp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "4r_pp2_vpp_dp2": {"pipeline_model_parallel_size": 2,
                       "num_layers_per_virtual_pipeline_stage": 1},
    "4r_tp2_sp_pp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                      "pipeline_model_parallel_size": 2},
    "4r_pp2_vpp_dp2_full_recompute": {"pipeline_model_parallel_size": 2,
                                      "num_layers_per_virtual_pipeline_stage": 1,
                                      "recompute_granularity": "full"},
    "4r_cp2_tp2_sp": {"context_parallel_size": 2, "tensor_model_parallel_size": 2,
                      "sequence_parallel": True},
    "4r_cp2_pp2": {"context_parallel_size": 2, "pipeline_model_parallel_size": 2},
    "4r_cp2_dp2": {"context_parallel_size": 2},
    "4r_cp2_pp2_vpp": {"context_parallel_size": 2, "pipeline_model_parallel_size": 2,
                       "num_layers_per_virtual_pipeline_stage": 1},
}
SINGLE_RANK = {
    "full_recompute": {"recompute_granularity": "full"},
    "selective_recompute": {"recompute_granularity": "selective",
                            "recompute_modules": ["core_attn", "mlp", "layernorm"]},
}
# fp32 on CPU: layouts differ from the reference only in reduction order
RTOL = 2e-5


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env():
    # PYTHONPATH: the workers import this checkout's package, whatever is installed
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(cmd, spec_path, timeout=600):
    proc = subprocess.run(cmd + [WORKER, spec_path], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture(scope="session")
def layout_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    ckpt, out = str(root / "ckpt"), str(root / "out")
    os.makedirs(out)
    ref_tasks = [{"name": "reference", "save": True}, {"name": "reference_lam0", "lam": 0.0},
                 {"name": "manual", "manual": True}]
    ref_tasks += [{"name": name, "parallel": p} for name, p in SINGLE_RANK.items()]
    two_tasks = [{"name": name, "parallel": p} for name, p in LAYOUTS.items()]
    two_tasks.append({"name": "pp2_lam0", "lam": 0.0, "parallel": LAYOUTS["pp2"]})
    four_tasks = [{"name": name, "parallel": p} for name, p in FOUR_RANK.items()]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    for label, tasks, cmd in (
        ("one", ref_tasks, [sys.executable]),
        ("two", two_tasks, launch + ["2"]),
        ("four", four_tasks, launch + ["4"]),
    ):
        spec = root / f"{label}.json"
        spec.write_text(json.dumps({"ckpt_dir": ckpt, "out_dir": out, "tasks": tasks}))
        _run(cmd, str(spec))

    def load(name):
        ranks = sorted(f for f in os.listdir(out) if f.startswith(name + ".rank"))
        return [torch.load(os.path.join(out, f), weights_only=False) for f in ranks]

    return load


def assemble(rank_results):
    """Rank results -> loss, metrics and full (unsharded) gradients."""
    losses = [r["lm_loss"] for r in rank_results if r["lm_loss"] is not None]
    grads = {}
    keys = {k for r in rank_results for k in r["grads"]}
    for key in keys:
        entries = [r["grads"][key] for r in rank_results if key in r["grads"]]
        if entries[0]["tp"]:
            by_rank = {e["tp_rank"]: e["grad"] for e in entries}
            shards = [by_rank[i] for i in sorted(by_rank)]
            if entries[0].get("glu"):  # each shard is [gate; up]: all gates, then all ups
                shards = [half for part in (0, 1) for half in (s.chunk(2)[part] for s in shards)]
            grads[key] = torch.cat(shards, dim=entries[0]["dim"])
        else:
            for e in entries[1:]:  # replicated copies must agree
                torch.testing.assert_close(e["grad"], entries[0]["grad"], rtol=0, atol=0)
            grads[key] = entries[0]["grad"]
    return {"loss": losses, "psi": [r["psi"] for r in rank_results],
            "R": [r["R"] for r in rank_results], "grads": grads,
            "microbatches": [r["microbatches"] for r in rank_results]}


def max_rel_diff(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def assert_matches_reference(got, ref):
    assert got["loss"], "no rank reported the LM loss"
    # each DP rank reports its own mean; TP ranks repeat theirs: the mean is the global loss
    assert max_rel_diff(sum(got["loss"]) / len(got["loss"]), ref["loss"][0]) < RTOL
    for psi, r in zip(got["psi"], got["R"]):  # every rank holds the reduced metrics
        assert max_rel_diff(psi, ref["psi"][0]) < RTOL
        assert max_rel_diff(r, ref["R"][0]) < RTOL
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in got["grads"].items():
        assert grad.shape == ref["grads"][key].shape, key
        assert max_rel_diff(grad, ref["grads"][key]) < RTOL, key


@pytest.mark.parametrize("layout", sorted(LAYOUTS) + sorted(FOUR_RANK))
def test_layout_matches_single_rank(layout_results, layout):
    ref = assemble(layout_results("reference"))
    assert_matches_reference(assemble(layout_results(layout)), ref)


@pytest.mark.parametrize("variant", sorted(SINGLE_RANK))
def test_recompute_matches_no_recompute(layout_results, variant):
    ref = assemble(layout_results("reference"))
    got = assemble(layout_results(variant))
    assert_matches_reference(got, ref)
    assert got["microbatches"] == [[4, 4, 4,
                                    4]], "recompute must record each layer once per micro-batch"


def test_recompute_records_once_under_parallelism(layout_results):
    for rank in layout_results("tp2_sp_full_recompute"):
        assert rank["microbatches"] == [4, 4, 4, 4]


def test_schedule_penalty_matches_plain_autograd(layout_results):
    """The carrier's gradient equals autograd of mean_mb(CE + lambda * sum_l w_l Psi_l)."""
    ref = assemble(layout_results("reference"))
    manual = assemble(layout_results("manual"))
    assert max_rel_diff(manual["psi"][0], ref["psi"][0]) < RTOL
    for key, grad in manual["grads"].items():
        assert max_rel_diff(ref["grads"][key], grad) < RTOL, key


def test_jreg_changes_gradients_on_both_pipeline_stages(layout_results):
    on, off = assemble(layout_results("pp2")), assemble(layout_results("pp2_lam0"))
    ref_on, ref_off = assemble(layout_results("reference")), assemble(
        layout_results("reference_lam0"))
    # layer 1 lives on stage 0, layer 4 on stage 1
    for key in ("layers.1.self_attention.linear_proj.weight", "layers.4.mlp.linear_fc2.weight",
                "embedding.word_embeddings.weight"):
        delta = on["grads"][key] - off["grads"][key]
        assert float(delta.abs().max()) > 1e-3 * float(on["grads"][key].abs().max()), key
        assert max_rel_diff(delta, ref_on["grads"][key] - ref_off["grads"][key]) < 1e-3, key
    # the output layer sits after the last JREG layer: its gradient does not change
    assert torch.equal(on["grads"]["output_layer.weight"], off["grads"]["output_layer.weight"])
    assert off["psi"][0] == pytest.approx(on["psi"][0], rel=RTOL)  # lambda = 0 still measures
