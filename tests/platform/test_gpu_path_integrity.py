"""No megatron-core fix is gated on CPU: the models a GPU run builds (TP2 + sequence
parallelism, selective recompute of layernorm, interleaved pipelining, full recompute)
build in a process where megatron_jreg.platform.cpu never ran, and their norms run
forward and backward there, through megatron's selective-recompute helper where the
layout recomputes layernorm (tests/platform/gpu_path_worker.py, 2 gloo ranks)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "platform", "gpu_path_worker.py")

TINY = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 192, "seq_length": 32, "vocab_size": 250, "transformer_impl": "local"}
CASES = {
    "tp2_sp": {"model": TINY,
               "parallel": {"tensor_model_parallel_size": 2, "sequence_parallel": True}},
    "tp2_sp_selective_layernorm": {"model": TINY, "parallel": {
        "tensor_model_parallel_size": 2, "sequence_parallel": True,
        "recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp",
                                                                    "layernorm"]}},
    "tp2_sp_full_recompute": {"model": TINY, "parallel": {
        "tensor_model_parallel_size": 2, "sequence_parallel": True,
                                                          "recompute_granularity": "full"}},
    "pp2_vpp2": {"model": TINY, "parallel": {"pipeline_model_parallel_size": 2,
                              "num_layers_per_virtual_pipeline_stage": 1}},
    "pp2_selective_layernorm_bf16": {"model": dict(TINY, bf16=True), "parallel": {
        "pipeline_model_parallel_size": 2, "recompute_granularity": "selective",
        "recompute_modules": ["layernorm"]}},
}


def run_worker(tmp_path, cases):
    out = tmp_path / "out"
    out.mkdir()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(out), "cases": cases}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=REPO)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", WORKER, str(spec)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("gpu_path"), CASES)


def test_the_cpu_redirection_never_ran(reports):
    for report in reports:
        assert report["cpu_redirection_active"] is False
        assert report["cpu_redirection_active_after"] is False


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_builds_and_its_norms_run_without_the_cpu_platform(reports, case):
    for report in reports:
        got = report["cases"][case]
        assert got["ok"], got.get("error")
        assert got["layer_class"] == ["JregTransformerLayer"]
        assert got["deallocate_pipeline_outputs"] is True
        assert got["norms_run"] > 0 and got["norm_grads_finite"]
        if CASES[case]["parallel"].get("sequence_parallel"):
            # finalize_model_grads all-reduces these over TP: every norm must be marked
            assert got["norms_sp_marked"] is True
    layers = sorted(l for report in reports for l in report["cases"][case]["layers"])
    pp = CASES[case]["parallel"].get("pipeline_model_parallel_size", 1)
    # each layer lives on one pipeline rank; TP ranks hold every layer of their stage
    assert layers == sorted(list(range(1, 5)) * (2 // pp))
