"""examples/demo.sh and examples/sft_tiny.sh run as written.

demo.sh runs once as the README gives it (its own 300 steps per run, into a fresh OUT):
pytest's slowest-tests list shows its time. sft_tiny.sh then fine-tunes the demo's two
checkpoints and measures them again (it finds them, so it does not run demo.sh); a second
run of the same command resumes everything and trains nothing.
"""

import json
import subprocess

import pytest
from trainer_runs import REPO, read_metrics, run_env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """`bash examples/demo.sh` with its defaults into a fresh OUT: (OUT, the process)."""
    out = tmp_path_factory.mktemp("readme_demo") / "demo"
    proc = subprocess.run(["bash", "examples/demo.sh"], cwd=REPO, env=dict(run_env(), OUT=str(out)),
                          capture_output=True, text=True, timeout=1500)
    return out, proc


def test_demo_as_the_readme_gives_it(demo_run):
    """The README's first command after its install: 300 steps of the tiny preset without
    and with JREG on the same seed and data. Both learn; the baseline develops a small
    final-layer jump (Psi_4 > Psi_3) that JREG lowers, in training and on held-out text."""
    out, proc = demo_run
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("done in ")
    runs = {lam: read_metrics(out / f"tiny_lambda{lam}" / "metrics.jsonl") for lam in ("0", "1.0")}
    for lam, rows in runs.items():
        assert rows[-1]["iteration"] == 300, lam
        assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 1.0, f"lambda {lam}: loss did not fall"
        runs[lam] = rows[-1]
    base, jreg = runs["0"], runs["1.0"]
    assert base["jreg_penalty"] == 0.0 and jreg["jreg_penalty"] > 0.0
    assert base["zeta_L"] > 0.0, "the baseline shows no final-layer jump to suppress"
    assert jreg["zeta_L"] < base["zeta_L"], (jreg["zeta_L"], base["zeta_L"])
    assert jreg["psi"][-1] < 0.7 * base["psi"][-1], (jreg["psi"], base["psi"])
    report = {r["model"]: r for r in json.loads((out / "jump.json").read_text())}
    assert set(report) == {"baseline", "jreg"}
    assert report["jreg"]["jump_rate"]["L"] < report["baseline"]["jump_rate"]["L"]
    assert (out / "jump.csv").stat().st_size > 0 and (out / "jump.png").stat().st_size > 0


def run_script(out, **env):
    full = dict(run_env(), OUT=str(out), TRAIN_ITERS="30", SFT_ITERS="8", **env)
    return subprocess.run(["bash", "examples/sft_tiny.sh"], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=1500)


def test_sft_tiny_fine_tunes_the_demos_checkpoints_and_prints_the_jump_after_it(demo_run):
    out, demo = demo_run
    assert demo.returncode == 0, (demo.stdout + demo.stderr)[-3000:]
    proc = run_script(out)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "running examples/demo.sh first" not in log  # it found the demo's checkpoints
    # both fine-tuning runs started from their pretrained checkpoints, at iteration 0
    for lam in ("0", "1.0"):
        assert f"fine-tuning from --pretrained-checkpoint {out}/tiny_lambda{lam}/checkpoints" in log
        rows = [json.loads(line) for line in open(out / f"sft_from_lambda{lam}" / "metrics.jsonl")]
        assert [r["iteration"] for r in rows if "lm_loss" in r][-1] == 8
    assert "% of the train split's token positions are padding" in log
    report = json.loads((out / "sft_jump.json").read_text())
    assert [r["model"] for r in report] == ["baseline-sft", "jreg-sft"]
    for r in report:
        assert r["num_layers"] == 4 and len(r["displacement"]) == 4
        assert set(r["jump_rate"]) == {"L", "L-1", "L-2"}
    # the Table 7 layout at the end: one row per model, zeta_L, zeta_L-1, zeta_L-2
    lines = proc.stdout[proc.stdout.index("== 3/3"):].splitlines()
    header = lines.index(next(line for line in lines if line.split()[:2] == ["model", "zeta_L"]))
    assert lines[header].split() == ["model", "zeta_L", "zeta_L-1", "zeta_L-2"]
    for line, r in zip(lines[header + 1:header + 3], report):
        name, *values = line.split()
        assert name == r["model"]
        assert [float(v) for v in values] == [round(r["jump_rate"][k], 4)
                                              for k in ("L", "L-1", "L-2")]

    again = run_script(out)
    log = again.stdout + again.stderr
    assert again.returncode == 0, log[-5000:]
    assert "running examples/demo.sh first" not in log and "fine-tuning from" not in log
    assert log.count("loaded checkpoint") == 2  # each SFT run resumed at its end
    assert json.loads((out / "sft_jump.json").read_text()) == report
