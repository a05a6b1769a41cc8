"""JREG on the other model families equals one rank under TP2, PP2 and DP2 (and EP2 for MoE).

Each family is the tiny preset with the family's flags (the same flags a launch script
passes): GPT-2 (LayerNorm, GeLU, learned positions, biases, tied embeddings), Qwen3
(query/key norms, GQA, RoPE base 1e6) and Mixtral (mixture of experts with the
load-balancing loss). One single-rank job saves each family's weights and runs the
reference, plus the plain-autograd check of mean_mb(CE + lambda * R + aux); one 2-rank job
runs every layout, loading those weights. Compared: the LM loss, every Psi_l, R and the
gradients of parameters on the first and the last layer (the family's own ones included).
"""

import json
import sys

import pytest
import torch
from test_parallel_layouts import RTOL, _run, assemble, assert_matches_reference, max_rel_diff

FAMILIES = {
    "gpt2": {"swiglu": False, "normalization": "LayerNorm",
             "position_embedding_type": "learned_absolute", "add_bias_linear": True,
             "untie_embeddings_and_output_weights": False, "group_query_attention": False,
             "ffn_hidden_size": 256},
    "qwen3": {"qk_layernorm": True, "rotary_base": 1000000},
    "mixtral": {"num_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
                "ffn_hidden_size": 96},
    # the Llama form with PyTorch's SDPA as core attention (model/attention.py)
    "sdpa": {"attention_backend": "sdpa"},
    "llama": {},
}
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
    "dp2": {},
}
# megatron-core runs MoE with TP only under sequence parallelism (as Megatron-LM requires)
MOE = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": LAYOUTS["pp2"],
    "dp2": LAYOUTS["dp2"],
    "ep2": {"expert_model_parallel_size": 2},
}
# the parameters each family adds, which must be tracked (so a layout that drops their
# gradient fails)
OWN = {
    "gpt2": {"embedding.position_embeddings.weight", "layers.1.self_attention.linear_qkv.bias",
             "layers.4.mlp.linear_fc1.bias", "layers.4.input_layernorm.bias"},
    "qwen3": {"layers.1.self_attention.q_layernorm.weight",
              "layers.4.self_attention.k_layernorm.weight"},
    "mixtral": {"layers.1.mlp.router.weight", "layers.4.mlp.router.weight",
                "layers.4.mlp.experts.local_experts.1.linear_fc1.weight",
                "layers.1.mlp.experts.local_experts.0.linear_fc2.weight"},
    "sdpa": {"layers.1.self_attention.linear_proj.weight"},
}


SDPA = {
    **LAYOUTS,
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "vpp2": {"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1},
    "pp2_full_recompute": {"pipeline_model_parallel_size": 2, "recompute_granularity": "full"},
    "tp2_sp_core_attn_recompute": {"tensor_model_parallel_size": 2, "sequence_parallel": True,
                                   "recompute_granularity": "selective",
                                   "recompute_modules": ["core_attn"]},
}


def _layouts(family):
    return {"mixtral": MOE, "sdpa": SDPA, "llama": {}}.get(family, LAYOUTS)


@pytest.fixture(scope="session")
def family_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    ckpt, out = str(root / "ckpt"), str(root / "out")
    (root / "out").mkdir()
    one, two = [], []
    for family, flags in FAMILIES.items():
        base = {"family": family, "model": flags}
        if family == "llama":  # megatron's attention on the SDPA run's weights
            one.append(dict(base, family="sdpa", name="llama.reference"))
            continue
        one += [dict(base, name=f"{family}.reference", save=True),
                dict(base, name=f"{family}.reference_lam0", lam=0.0),
                dict(base, name=f"{family}.manual", manual=True)]
        if family == "sdpa":
            one.append(dict(base, name="sdpa.core_attn_recompute", parallel={
                "recompute_granularity": "selective", "recompute_modules": ["core_attn"]}))
        two += [dict(base, name=f"{family}.{name}", parallel=p)
                for name, p in _layouts(family).items()]
    for label, tasks, cmd in (
        ("one", one, [sys.executable]),
        ("two", two, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                      "--nproc_per_node", "2"]),
    ):
        spec = root / f"{label}.json"
        spec.write_text(json.dumps({"ckpt_dir": ckpt, "out_dir": out, "tasks": tasks}))
        _run(cmd, str(spec))

    def load(name):
        files = sorted(p for p in (root / "out").iterdir() if p.name.startswith(name + ".rank"))
        return assemble([torch.load(p, weights_only=False) for p in files])

    return load


CASES = [(family, layout) for family in FAMILIES for layout in sorted(_layouts(family))]
OWN_FAMILIES = sorted(set(FAMILIES) - {"llama"})


@pytest.mark.parametrize("family,layout", CASES, ids=[f"{f}-{l}" for f, l in CASES])
def test_family_layout_matches_single_rank(family_results, family, layout):
    ref = family_results(f"{family}.reference")
    assert OWN[family] <= set(ref["grads"]), "the family's own parameters are tracked"
    assert_matches_reference(family_results(f"{family}.{layout}"), ref)


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_family_penalty_matches_plain_autograd(family_results, family):
    """The schedule's gradients (JREG carriers, and the MoE load-balancing loss at its
    scale) equal autograd of mean_mb(CE + lambda * sum_l w_l Psi_l + aux)."""
    ref, manual = family_results(f"{family}.reference"), family_results(f"{family}.manual")
    assert max_rel_diff(manual["psi"][0], ref["psi"][0]) < RTOL
    assert set(manual["grads"]) == set(ref["grads"])
    for key, grad in manual["grads"].items():
        assert max_rel_diff(ref["grads"][key], grad) < RTOL, key


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_jreg_changes_the_family_gradients(family_results, family):
    on, off = family_results(f"{family}.reference"), family_results(f"{family}.reference_lam0")
    for key in OWN[family] | {"layers.1.self_attention.linear_proj.weight"}:
        delta = (on["grads"][key] - off["grads"][key]).abs().max()
        assert float(delta) > 1e-4 * float(on["grads"][key].abs().max()), key
    assert off["psi"][0] == pytest.approx(on["psi"][0], rel=RTOL)


def test_sdpa_backend_leaves_loss_displacement_and_gradients_unchanged(family_results):
    """SDPA and megatron's own attention on the same weights and batch (fp32): the LM loss,
    every Psi_l, R and the gradients agree; so does SDPA under core-attention recompute."""
    sdpa, megatron = family_results("sdpa.reference"), family_results("llama.reference")
    assert_matches_reference(megatron, sdpa)
    assert_matches_reference(family_results("sdpa.core_attn_recompute"), sdpa)
