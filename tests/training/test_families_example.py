"""examples/jreg_across_families.sh run as written (its FAMILIES knob set), and each
family's JREG checkpoint through convert_to_hf and eval_jump."""

import json
import os
import subprocess

from trainer_runs import REPO, run_env

from forked_trainer import run_tool

ITERS = 21  # steps of each run (the script warms up for 20)
EVAL_TOKENS = 8192  # tokens eval_jump reads per model
FAMILIES = ("gpt2", "mixtral")


def prepared_files(data_dir):
    """{name: mtime} of the files of a demo data directory (not the trainers' index cache)."""
    return {f: os.stat(os.path.join(data_dir, f)).st_mtime_ns for f in os.listdir(data_dir)
            if os.path.isfile(os.path.join(data_dir, f))}


def test_jreg_across_families_trains_each_family_and_reports_zeta(tmp_path, demo_sp_data):
    """examples/jreg_across_families.sh as written, with its FAMILIES knob set to the two
    families least like Llama (GPT-2: LayerNorm, learned positions, biases, tied output;
    Mixtral: experts), without and with JREG, measured by eval_jump; each checkpoint holds
    its family's model. DATA_DIR is the demo data the fixture built with
    prepare_demo_data.sh's commands (the script finds it complete and builds nothing)."""
    out, data_dir = tmp_path / "families", os.path.dirname(demo_sp_data[0])
    env = dict(run_env(), OUT=str(out), DATA_DIR=data_dir, TRAIN_ITERS=str(ITERS),
               EVAL_TOKENS=str(EVAL_TOKENS), FAMILIES=" ".join(FAMILIES))
    built = prepared_files(data_dir)
    proc = subprocess.run(["bash", "examples/jreg_across_families.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert prepared_files(data_dir) == built  # prepare_demo_data.sh found it complete
    names = [f"{f}-{v}" for f in FAMILIES for v in ("baseline", "jreg")]
    report = json.loads((out / "jump.json").read_text())
    assert [r["model"] for r in report] == names
    for r in report:
        assert r["num_layers"] == 4 and len(r["displacement"]) == 4
        assert set(r["jump_rate"]) == {"L", "L-1", "L-2"}
    for name in names:
        family = name.split("-")[0]
        config = (out / name / "checkpoints" / f"iter_{ITERS:07d}" / "run_config.yaml").read_text()
        preset = "tiny" if family == "llama" else f"{family}-tiny"
        assert f"model_preset: {preset}" in config, name
        rows = [json.loads(line) for line in open(out / name / "metrics.jsonl")]
        lam = [r["jreg_penalty"] for r in rows if "jreg_penalty" in r]
        # lambda 0 measures without a penalty; lambda 1 pays one
        assert (max(lam) == 0.0) == name.endswith("baseline"), name
    # the summary table eval_jump prints: one row per model, zeta_L, zeta_L-1, zeta_L-2
    lines = proc.stdout.splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["model", "zeta_L"]))
    assert [line.split()[0] for line in lines[header + 1:header + 1 + len(names)]] == names
    # each family's JREG checkpoint exports to its Hugging Face class, and eval_jump on the
    # export measures what it measured on the checkpoint
    classes = {"gpt2": "GPT2LMHeadModel", "mixtral": "MixtralForCausalLM"}
    by_name = {r["model"]: r for r in report}
    for family, hf_class in classes.items():
        name, hf_dir = f"{family}-jreg", tmp_path / f"hf-{family}"
        for script, argv in (
                ("tools/convert_to_hf.py",
                 ["--load", out / name / "checkpoints", "--output", hf_dir]),
                ("tools/eval_jump.py", ["--hf-model", hf_dir, "--label", name,
                                        "--data-path", demo_sp_data[0], "--seq-length", "128",
                                        "--max-tokens", EVAL_TOKENS, "--batch-size", "16",
                                        "--json", tmp_path / f"{family}.json"])):
            step = run_tool(script, argv, run_env())
            assert step.returncode == 0, step.stderr[-3000:]
        assert json.loads((hf_dir / "config.json").read_text())["architectures"] == [hf_class]
        hf = json.loads((tmp_path / f"{family}.json").read_text())  # one model: one object
        assert hf["tokens"] == by_name[name]["tokens"]
        for a, b in zip(hf["displacement"], by_name[name]["displacement"]):
            assert abs(a - b) <= 1e-4 * abs(b) + 1e-7, (family, hf["displacement"],
                                                         by_name[name]["displacement"])
