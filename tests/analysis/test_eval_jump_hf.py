"""eval_jump --hf-model against an independent computation from HF's own outputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_jreg.commands.eval_jump import main

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


def document_lengths(model_dir, documents):
    """Tokens per document as the model's tokenizer gives them (<s> included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [len(tokenizer(doc)["input_ids"]) for doc in documents]


def progress_counts(stderr, label, total=None):
    """The token counts a tqdm bar drew on stderr, in order (``N/total`` with a total)."""
    from tqdm import tqdm

    if total is None:
        found = re.findall(rf"{re.escape(label)}: (\S+)tok \[", stderr)
    else:
        found = re.findall(
            rf"{re.escape(label)}: +\d+%\|[^|]*\| (\S+)/{re.escape(tqdm.format_sizeof(total))} \[",
            stderr,
        )
    assert found, stderr
    return found


def expected_progress(lengths, batch_size):
    """0, then the real tokens counted after each batch, as tqdm's unit_scale prints them."""
    from tqdm import tqdm

    sums, total = [0], 0
    for start in range(0, len(lengths), batch_size):
        total += sum(lengths[start : start + batch_size])
        sums.append(total)
    return [tqdm.format_sizeof(n) for n in sums]


@pytest.fixture(scope="module")
def other_hf_model(tiny_hf_model, tmp_path_factory):
    """The fixture's model, last MLP weakened (a smaller jump) and layer 1's attention
    output strengthened (a larger Psi_1); the same tokenizer."""
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("hf_other") / "other-llama"
    model = AutoModelForCausalLM.from_pretrained(tiny_hf_model, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[-1].mlp.down_proj.weight.mul_(0.1)
        model.model.layers[0].self_attn.o_proj.weight.mul_(3.0)
    model.save_pretrained(str(path))
    for name in os.listdir(tiny_hf_model):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tiny_hf_model, name), path / name)
    return str(path)


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


def test_two_models_compare_csv_and_plot(tiny_hf_model, other_hf_model, eval_text, tmp_path,
                                         capsys):
    out = tmp_path / "both.json"
    csv_path, png = tmp_path / "both.csv", tmp_path / "both.png"
    rc = main(
        [
            "--hf-model",
            tiny_hf_model,
            other_hf_model,
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

    # The Delta table: A is the first model, B the second, Delta_l = Psi_l(B) - Psi_l(A).
    psi_a, psi_b = reports[0]["displacement"], reports[1]["displacement"]
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("A: a   B: b   Delta_l = Psi_l(B) - Psi_l(A)")
    assert lines[start + 1].split() == ["layer", "Psi_l(A)", "Psi_l(B)", "Delta_l"]
    rows = [line.split() for line in lines[start + 2 : start + 2 + 3]]
    more = []
    for layer, (row, pa, pb) in enumerate(zip(rows, psi_a, psi_b), start=1):
        delta = pb - pa
        assert row[:3] == [str(layer), f"{pa:.6f}", f"{pb:.6f}"], row
        assert float(row[3]) == pytest.approx(delta, abs=5e-7 + 1e-12), (layer, row, delta)
        assert row[3] == f"{delta:+.6f}"
        assert (row[4:] == ["B", "moves", "more"]) is (pb > pa)
        if pb > pa:
            more.append(str(layer))
    assert lines[start + 5] == (
        f"layers where B moves more than A: {', '.join(more) if more else 'none'}"
    )
    assert max(abs(pb - pa) for pa, pb in zip(psi_a, psi_b)) > 1e-3  # two different models
    za, zb = reports[0]["jump_rate"]["L"], reports[1]["jump_rate"]["L"]
    assert lines[start + 6] == f"zeta_L: A {za:.4f}   B {zb:.4f}"


def test_progress_bar_counts_real_tokens_up_to_max_tokens(
    tiny_hf_model, eval_text, eval_documents, tmp_path, capsys, monkeypatch
):
    """With --max-tokens the bar's total is the cap and it ends at N/N, N = the report's tokens."""
    import tqdm as tqdm_module

    class EveryUpdate(tqdm_module.tqdm):  # draw on every update, however fast
        def __init__(self, *args, **kwargs):
            kwargs.update(mininterval=0, miniters=1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm_module, "tqdm", EveryUpdate)
    out = tmp_path / "progress.json"
    argv = ["--hf-model", tiny_hf_model, "--text-file", eval_text, "--batch-size", "3",
            "--max-tokens", "40", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == 40
    lengths, cut = [], 0
    for n in document_lengths(tiny_hf_model, eval_documents):  # the documents under the cap
        lengths.append(min(n, 40 - cut))
        cut += lengths[-1]
        if cut == 40:
            break
    label = os.path.basename(tiny_hf_model)
    counts = progress_counts(capsys.readouterr().err, label, total=40)
    assert counts == expected_progress(lengths, 3)  # each batch adds its unpadded tokens
    assert counts[-1] == "40.0"  # ends at 40.0/40.0


def test_subprocess_prints_table(tiny_hf_model, eval_text, eval_documents, tmp_path):
    out = tmp_path / "sub.json"
    # tqdm reads TQDM_* defaults from the environment: draw every update, however fast
    env = dict(os.environ, TQDM_MININTERVAL="0", TQDM_MINITERS="1")
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
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "layer" in proc.stdout and "Psi_l" in proc.stdout and "zeta_L =" in proc.stdout
    report = json.loads(out.read_text())
    # the progress bar goes to stderr and counts the real (unpadded) tokens of each batch
    # of 8 documents (the default), up to the report's token count
    import tqdm.utils

    lengths = document_lengths(tiny_hf_model, eval_documents)
    assert sum(lengths) == report["tokens"]
    counts = progress_counts(proc.stderr, os.path.basename(tiny_hf_model))
    if hasattr(tqdm.utils, "envwrap"):  # tqdm >= 4.66 reads TQDM_*; older ones draw what they like
        assert counts == expected_progress(lengths, 8)
        assert counts[-1] == tqdm.tqdm.format_sizeof(report["tokens"])
    assert "tok/s" not in proc.stdout  # the bar stays off stdout
    for layer, psi in enumerate(report["displacement"], start=1):
        assert f"{layer:>5}  {psi:10.6f}" in proc.stdout
