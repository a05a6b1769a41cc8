"""eval_jump --hf-model against an independent computation from HF's own outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_jreg.analysis.eval_jump_cli import main

pytest.importorskip("transformers")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-6


def independent_displacement(model_dir, documents, include_final_norm, seq_length=2048):
    """Psi_l from output_hidden_states, one document at a time (no padding at all).

    HF's hidden_states[-1] already has the final norm applied, so the pre-norm h_L comes
    from a forward hook on the last decoder layer.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    last = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda mod, args, out: last.append(out[0] if isinstance(out, tuple) else out)
    )
    num_layers = model.config.num_hidden_layers
    sums = torch.zeros(num_layers, dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for doc in documents:
            ids = tokenizer(doc)["input_ids"][:seq_length]
            last.clear()
            out = model(torch.tensor([ids]), output_hidden_states=True)
            states = list(out.hidden_states)  # h_0 .. h_{L-1}, then norm(h_L)
            assert len(states) == num_layers + 1
            if not include_final_norm:
                states[-1] = last[0]
            for layer in range(1, num_layers + 1):
                a, b = states[layer - 1][0].double(), states[layer][0].double()
                cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
                sums[layer - 1] += ((1 - cos) / 2).sum()
            tokens += len(ids)
    handle.remove()
    return (sums / tokens).tolist(), tokens


def run_json(tmp_path, *args, name="out.json"):
    out = tmp_path / name
    rc = main([*map(str, args), "--json", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("include_final_norm", [False, True])
def test_matches_output_hidden_states(
    tiny_hf_model, eval_text, eval_documents, tmp_path, include_final_norm
):
    flags = ["--include-final-norm"] if include_final_norm else []
    report = run_json(
        tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text, "--batch-size", 4, *flags
    )
    expected, tokens = independent_displacement(tiny_hf_model, eval_documents, include_final_norm)
    assert report["tokens"] == tokens
    assert report["include_final_norm"] is include_final_norm
    assert report["displacement"] == pytest.approx(expected, abs=TOL, rel=0)
    # The fixture's model has a jump, and the final norm changes h_L's direction.
    assert report["jump_rate"]["L"] > 10


def test_final_norm_changes_only_the_last_layer(tiny_hf_model, eval_text, tmp_path):
    pre = run_json(tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text, name="pre.json")
    post = run_json(
        tmp_path,
        "--hf-model",
        tiny_hf_model,
        "--text-file",
        eval_text,
        "--include-final-norm",
        name="post.json",
    )
    assert pre["displacement"][:-1] == pytest.approx(post["displacement"][:-1], abs=1e-12)
    assert abs(pre["displacement"][-1] - post["displacement"][-1]) > 1e-4


def test_json_shape(tiny_hf_model, eval_text, tmp_path):
    report = run_json(
        tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text, "--label", "tiny"
    )
    assert report["model"] == "tiny"
    assert report["num_layers"] == 3
    assert isinstance(report["tokens"], int) and report["tokens"] > 0
    assert len(report["displacement"]) == 3 and all(
        isinstance(p, float) for p in report["displacement"]
    )
    # L = 3: zeta_L and zeta_{L-1} = zeta_2 exist; zeta_{L-2} = zeta_1 does not.
    assert set(report["jump_rate"]) == {"L", "L-1"}
    assert isinstance(report["include_final_norm"], bool)
    psi = report["displacement"]
    assert report["jump_rate"]["L"] == pytest.approx(100 * max(0.0, psi[2] - psi[1]))


def test_batch_size_does_not_change_the_numbers(tiny_hf_model, eval_text, tmp_path):
    one = run_json(
        tmp_path,
        "--hf-model",
        tiny_hf_model,
        "--text-file",
        eval_text,
        "--batch-size",
        1,
        name="b1.json",
    )
    three = run_json(
        tmp_path,
        "--hf-model",
        tiny_hf_model,
        "--text-file",
        eval_text,
        "--batch-size",
        3,
        name="b3.json",
    )
    assert one["tokens"] == three["tokens"]
    assert one["displacement"] == pytest.approx(three["displacement"], abs=TOL, rel=0)


def test_seq_length_and_max_tokens(tiny_hf_model, eval_text, eval_documents, tmp_path):
    cut = run_json(
        tmp_path,
        "--hf-model",
        tiny_hf_model,
        "--text-file",
        eval_text,
        "--seq-length",
        5,
        name="s.json",
    )
    expected, tokens = independent_displacement(tiny_hf_model, eval_documents, False, seq_length=5)
    assert cut["tokens"] == tokens == 5 * len(eval_documents)  # every document has >= 4 words + <s>
    assert cut["displacement"] == pytest.approx(expected, abs=TOL, rel=0)
    capped = run_json(
        tmp_path,
        "--hf-model",
        tiny_hf_model,
        "--text-file",
        eval_text,
        "--max-tokens",
        17,
        name="m.json",
    )
    assert capped["tokens"] == 17


def test_jsonl_and_indexed_dataset_inputs_agree_with_text(
    tiny_hf_model, eval_text, eval_documents, tmp_path
):
    from transformers import AutoTokenizer

    text = run_json(tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text, name="t.json")
    jsonl = tmp_path / "eval.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(eval_documents))
    )
    from_jsonl = run_json(
        tmp_path, "--hf-model", tiny_hf_model, "--jsonl", jsonl, "--json-key", "body", name="j.json"
    )
    assert from_jsonl["displacement"] == pytest.approx(text["displacement"], abs=1e-12)

    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tokenizer = AutoTokenizer.from_pretrained(tiny_hf_model)
    prefix = str(tmp_path / "eval_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in eval_documents:
        builder.add_document(
            np.array(tokenizer(doc)["input_ids"], dtype=np.int32),
            [len(tokenizer(doc)["input_ids"])],
        )
    builder.finalize(prefix + ".idx")
    indexed = run_json(tmp_path, "--hf-model", tiny_hf_model, "--data-path", prefix, name="d.json")
    assert indexed["tokens"] == text["tokens"]
    assert indexed["displacement"] == pytest.approx(text["displacement"], abs=1e-12)


def test_two_models_compare_csv_and_plot(tiny_hf_model, eval_text, tmp_path):
    out = tmp_path / "both.json"
    csv_path, png = tmp_path / "both.csv", tmp_path / "both.png"
    rc = main(
        [
            "--hf-model",
            tiny_hf_model,
            tiny_hf_model,
            "--label",
            "a",
            "--label",
            "b",
            "--text-file",
            eval_text,
            "--max-tokens",
            "40",
            "--compare",
            "--json",
            str(out),
            "--csv",
            str(csv_path),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert rc == 0
    reports = json.loads(out.read_text())
    assert [r["model"] for r in reports] == ["a", "b"]
    assert csv_path.read_text().splitlines()[0] == "model,layer,displacement,jump_rate"
    assert len(csv_path.read_text().splitlines()) == 1 + 2 * 3
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]  # temp files renamed away


def test_subprocess_prints_table(tiny_hf_model, eval_text, tmp_path):
    out = tmp_path / "sub.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "tools", "eval_jump.py"),
            "--hf-model",
            tiny_hf_model,
            "--text-file",
            eval_text,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layer" in proc.stdout and "Psi_l" in proc.stdout and "zeta_L =" in proc.stdout
    assert "tok" in proc.stderr  # the progress bar goes to stderr
    report = json.loads(out.read_text())
    for layer, psi in enumerate(report["displacement"], start=1):
        assert f"{layer:>5}  {psi:10.6f}" in proc.stdout
