"""eval_jump's --dtype, --device, --iterations and --title, each shown by what it changes.

--dtype against HF's own hidden states of the model loaded in that dtype, and both flags
(or --device-map) as each report records them; --device by its refusal of a device this
machine lacks; --iterations by the checkpoints a trajectory measures (the latest one
against the trainer's own Psi_l); --title by the text of the written figure (an SVG keeps
each text as a comment).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from checkpoint_runs import ITERS, SEQ, run

from megatron_jreg.analysis.jump_accumulator import JumpReport
from megatron_jreg.commands.eval_jump import main

pytest.importorskip("transformers")


def hf_displacement(model_dir, documents, dtype):
    """Psi_l of the model loaded in ``dtype``: HF's output_hidden_states (the last one after
    the final norm), one document at a time, the cosine in float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    sums = torch.zeros(model.config.num_hidden_layers, dtype=torch.float64)
    tokens = 0
    with torch.no_grad():
        for doc in documents:
            ids = tokenizer(doc)["input_ids"]
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            for layer in range(1, len(states)):
                a, b = states[layer - 1][0].double(), states[layer][0].double()
                cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
                sums[layer - 1] += ((1 - cos) / 2).sum()
            tokens += len(ids)
    return (sums / tokens).tolist(), tokens


def run_report(tmp_path, *args):
    out = tmp_path / "out.json"
    rc = main([*map(str, args), "--json", str(out), "--no-progress"])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fp32_reference(tiny_hf_model, eval_documents):
    return hf_displacement(tiny_hf_model, eval_documents, torch.float32)


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16),
                                               ("float16", torch.float16)])
def test_dtype_measures_the_model_in_that_dtype(
    tiny_hf_model, eval_text, eval_documents, fp32_reference, tmp_path, dtype, torch_dtype
):
    report = run_report(tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text,
                        "--include-final-norm", "--batch-size", 1, "--dtype", dtype)  # no padding
    low, tokens = hf_displacement(tiny_hf_model, eval_documents, torch_dtype)
    fp32, _ = fp32_reference
    assert report["tokens"] == tokens
    assert (report["dtype"], report["device"]) == (dtype, "cpu")  # the report says how it ran
    got = report["displacement"]
    # the hidden states of the low-precision model; only the cosine's own rounding differs
    assert got == pytest.approx(low, rel=1e-6)
    # and not the fp32 model's: the weights' rounding moves Psi_l by far more than that
    assert max(abs(a - b) / b for a, b in zip(low, fp32)) > 1e-4
    # rounding only: each Psi_l stays within a few percent of fp32
    assert got == pytest.approx(fp32, rel=0.05)


def test_float32_and_device_cpu_are_the_fp32_model(
    tiny_hf_model, eval_text, fp32_reference, tmp_path
):
    report = run_report(tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text,
                        "--include-final-norm", "--device", "cpu", "--dtype", "float32")
    psi, tokens = fp32_reference
    assert report["tokens"] == tokens
    assert report["displacement"] == pytest.approx(psi, rel=1e-6, abs=1e-9)
    assert (report["dtype"], report["device"]) == ("float32", "cpu")


def test_device_map_is_recorded_in_place_of_device(tiny_hf_model, eval_text, fp32_reference,
                                                   tmp_path):
    """--device-map auto replaces --device: the report names the map, and no device."""
    pytest.importorskip("accelerate")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the layers would not all run on the CPU")
    report = run_report(tmp_path, "--hf-model", tiny_hf_model, "--text-file", eval_text,
                        "--include-final-norm", "--device-map", "auto", "--dtype", "bfloat16")
    assert (report["dtype"], report["device_map"]) == ("bfloat16", "auto")
    assert "device" not in report
    # bfloat16 weights indeed: not the fp32 model's Psi_l, but within rounding of it
    psi, _ = fp32_reference
    assert report["displacement"] != pytest.approx(psi, rel=1e-4)
    assert report["displacement"] == pytest.approx(psi, rel=0.05)


def test_reports_keep_dtype_and_device_and_older_reports_load(tmp_path):
    """--reports reads a report with dtype/device and one written without them (an older
    eval_jump); --json writes each back with the keys it had."""
    values = dict(num_layers=3, tokens=10, displacement=[0.1, 0.2, 0.5], include_final_norm=False)
    new = JumpReport(model="new", extra={"dtype": "bfloat16", "device": "cuda"}, **values)
    old = JumpReport(model="old", **values)
    files = []
    for report in (new, old):
        files.append(tmp_path / f"{report.model}.json")
        files[-1].write_text(report.to_json())
    out = tmp_path / "both.json"
    assert main(["--reports", *map(str, files), "--json", str(out)]) == 0
    both = json.loads(out.read_text())
    assert both == [json.loads(f.read_text()) for f in files]
    assert (both[0]["dtype"], both[0]["device"]) == ("bfloat16", "cuda")
    assert "dtype" not in both[1] and "device" not in both[1]


@pytest.mark.parametrize("device,message", [
    ("cuda", "--device cuda: CUDA is not available here; use --device cpu"),
    ("gpu0", "--device gpu0: not a device name; use cpu, cuda or cuda:N"),
])
def test_unavailable_device_is_refused_in_one_line(
    tiny_hf_model, eval_text, tmp_path, capsys, device, message
):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    out = tmp_path / "out.json"
    rc = main(["--hf-model", tiny_hf_model, "--text-file", str(eval_text), "--device", device,
               "--json", str(out), "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err == f"eval_jump: error: {message}\n"
    assert captured.out == "" and not out.exists()  # refused before any table or file


# ---- --title: the figure's text ------------------------------------------------------------


def svg_texts(path):
    """The texts of a matplotlib SVG, in drawing order (each is written as a comment)."""
    return re.findall(r"<!-- (.*?) -->", path.read_text())


def test_title_is_the_plots_title(tmp_path):
    pytest.importorskip("matplotlib")
    report = JumpReport(model="m", num_layers=3, tokens=10, displacement=[0.1, 0.2, 0.5],
                        include_final_norm=False)
    saved = tmp_path / "m.json"
    saved.write_text(report.to_json())
    plain, titled = tmp_path / "plain.svg", tmp_path / "titled.svg"
    assert main(["--reports", str(saved), "--plot", str(plain)]) == 0
    title = "Psi_l of model m, eval set B"
    assert main(["--reports", str(saved), "--plot", str(titled), "--title", title]) == 0
    without, with_title = svg_texts(plain), svg_texts(titled)
    assert title not in without and with_title.count(title) == 1
    with_title.remove(title)
    assert with_title == without  # the title is the only text the flag adds


# ---- --iterations: the checkpoints of a trajectory -----------------------------------------


def test_iterations_measure_exactly_those_checkpoints(
    trained_checkpoints, checkpoint_text, checkpoint_reference, tmp_path
):
    """The run saved iterations 1..ITERS; --iterations ITERS 1 measures the two ends only
    (a shift by one either way would ask for an iteration that does not exist)."""
    pytest.importorskip("matplotlib")
    out, svg = tmp_path / "t.json", tmp_path / "t.svg"
    title = "trajectory of tp1"
    proc = run([sys.executable, "tools/eval_jump.py", "--load", trained_checkpoints["tp1"],
                "--iterations", str(ITERS), "1", "--text-file", checkpoint_text[0],
                "--seq-length", str(SEQ), "--json", str(out), "--plot", str(svg),
                "--title", title, "--no-progress"])
    reports = json.loads(out.read_text())
    assert [r["iteration"] for r in reports] == [ITERS, 1]
    assert [r["model"] for r in reports] == [f"tp1@{ITERS}", "tp1@1"]
    assert all(r["tokens"] == 8 * SEQ for r in reports)
    assert all((r["dtype"], r["device"]) == ("float32", "cpu") for r in reports)  # the defaults
    # the last checkpoint measures as the trainer's own JREG code does on it
    psi = checkpoint_reference[trained_checkpoints["tp1"]]["psi"]
    assert reports[0]["displacement"] == pytest.approx(psi, abs=1e-6)
    # the first is another checkpoint: training moved every Psi_l
    assert all(abs(a - b) > 1e-4 for a, b in zip(reports[1]["displacement"], psi))
    # the trajectory table has a row per measured iteration, in order, and no other
    rows = re.findall(r"^ +(\d+) +\d+\.\d{4} ", proc.stdout, flags=re.M)
    assert rows == ["1", str(ITERS)]
    # the trajectory figure carries --title once (its suptitle), and its legend (titled
    # "iteration", the last texts but the title) names the measured iterations only
    texts = svg_texts(svg)
    assert texts.count(title) == 1
    texts.remove(title)
    legend = texts[len(texts) - 1 - texts[::-1].index("iteration"):]
    assert legend == ["iteration", "1", str(ITERS)]
