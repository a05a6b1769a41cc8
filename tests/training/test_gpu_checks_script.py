"""bench/gpu_checks.py, the one prepared GPU run, at toy sizes on the CPU: the preflight,
every check with its JSONL row as it finishes (the GPU figures come from a lent GPU), the
CUDA plan's time budget, and a check past its limit killed with its children."""

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time

from trainer_runs import REPO, run_env


def _gpu_checks():
    spec = importlib.util.spec_from_file_location("gpu_checks",
                                                  os.path.join(REPO, "bench", "gpu_checks.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_checks"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_gpu_checks_quick_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gpu_checks.py", "--device", "cpu", "--quick"],
                          cwd=REPO, env=dict(run_env(), OUT=str(tmp_path)), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    for line in ("preflight: interpreter:", "preflight: torch:", "preflight: numpy:",
                 "preflight: megatron.core:", "preflight: package modules: ok", "preflight: nvcc:",
                 "preflight: megatron_jreg._C: built", "preflight: gpu: skipped (cpu)"):
        assert line in proc.stdout, line
    assert "summary (cpu, quick" in proc.stdout

    rows = _rows(tmp_path / "gpu_checks.jsonl")
    assert rows[0]["run"] == "gpu_checks" and rows[0]["preflight"]["gpu"] == "skipped (cpu)"
    by_name = {r["check"]: r for r in rows if "check" in r}
    gpu_checks = _gpu_checks()
    for name, _, _ in gpu_checks.checks("cpu", True):
        expected = "skipped" if gpu_checks.needs_te(name) else "ok"
        assert by_name[name]["status"] == expected, by_name[name]
    # the attention each step built is the one the row names
    for jreg in ("off", "on"):
        assert by_name[f"1b sdpa, JREG {jreg}"]["result"]["attention"] == "sdpa"
    assert by_name["1b sdpa: JREG on/off step time"]["status"] == "ok"
    context = by_name["context parallel CP1 vs CP2"]
    assert context["result"]["check"]["ok"] and context["figure"].startswith("seq 256: "
                                                                             "CP2/CP1 step time")

    resume = by_name["trainer resume"]["result"]
    assert resume["steps_compared"] == [5, 6, 7, 8] and resume["precision"] == "fp32"
    assert isinstance(resume["max_abs_diff"], float) and resume["max_abs_diff"] == 0.0  # bit-exact

    formats = by_name["checkpoint formats"]["result"]
    assert {(r["save"], r["format"]) for r in formats["rows"]} == {
        (save, fmt) for save in ("plain", "fully parallel", "async")
        for fmt in ("dp_reshardable", "fully_reshardable")}
    assert "async blocks" in by_name["checkpoint formats"]["figure"]

    errors = by_name["kernel accuracy"]["result"]["errors"]
    for dtype, limit in (("fp32", 1e-5), ("bf16", 1e-2)):
        for kind in ("psi", "grad_a", "grad_b"):
            value = errors[dtype][kind]
            assert math.isfinite(value) and value < limit, (dtype, kind, value)


def test_cuda_plan_fits_the_budget():
    gpu_checks = _gpu_checks()
    total = gpu_checks.plan_limit_s("cuda", quick=False)
    assert total == sum(gpu_checks.LIMITS_S.values()) <= gpu_checks.BUDGET_S <= 480
    names = [name for name, _, _ in gpu_checks.checks("cuda", False)]
    assert {"gpu tests", "trainer resume", "kernel accuracy", "checkpoint formats",
            "context parallel CP1 vs CP2"} <= set(names)


def _live_members(pgid):
    """Processes of group ``pgid`` that are not zombies (a zombie holds no GPU memory)."""
    live = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(pid))
    return live


def test_a_check_past_its_limit_is_killed_with_its_children():
    gpu_checks = _gpu_checks()
    t0 = time.time()
    run = gpu_checks.run_check(["bash", "-c", "sleep 100 & sleep 100"], limit=1, echo=False)
    assert run.code == "timeout" and time.time() - t0 < 10
    deadline = time.time() + 5
    while _live_members(run.pgid) and time.time() < deadline:
        time.sleep(0.1)
    assert _live_members(run.pgid) == []


def test_a_cut_run_keeps_the_finished_checks_rows(tmp_path):
    proc = subprocess.Popen([sys.executable, "bench/gpu_checks.py", "--device", "cpu", "--quick",
                             "--only", "kernel accuracy", "trainer resume"], cwd=REPO,
                            env=dict(run_env(), OUT=str(tmp_path)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("==> trainer resume"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    rows = _rows(tmp_path / "gpu_checks.jsonl")
    assert [r.get("check") for r in rows if "check" in r] == ["kernel accuracy"]
    assert rows[1]["status"] == "ok" and rows[-1] == {"cut": "SIGTERM", "after_checks": 1}


def _gpu_checks_run(args, tmp_path, **env):
    return subprocess.run([sys.executable, "bench/gpu_checks.py", "--device", "cpu", "--quick",
                           "--quiet-preflight"] + args, cwd=REPO, env=dict(run_env(), **env),
                          capture_output=True, text=True, timeout=300)


def test_bad_requests_stop_before_the_preflight_with_one_line(tmp_path):
    nothing = _gpu_checks_run(["--only", "nosuch"], tmp_path, OUT=str(tmp_path))
    assert nothing.returncode == 2 and nothing.stderr.count("\n") == 1
    assert "--only nosuch: no check of the cpu plan has that in its name" in nothing.stderr
    assert not (tmp_path / "gpu_checks.jsonl").exists()
    a_dir = _gpu_checks_run(["--only", "kernel", "--jsonl", str(tmp_path)], tmp_path)
    assert a_dir.returncode == 2 and "cannot write there (Is a directory)" in a_dir.stderr
    (tmp_path / "taken.jsonl").write_text('{"run": "another"}\n')
    gc = _gpu_checks()
    first = gc.Jsonl(str(tmp_path / "taken.jsonl"))  # a run holding it
    second = _gpu_checks_run(["--only", "kernel", "--jsonl", str(tmp_path / "taken.jsonl")],
                             tmp_path)
    assert second.returncode == 2 and "another gpu_checks run is writing it" in second.stderr
    first.write({"check": "x", "error": float("nan")})
    assert _rows(tmp_path / "taken.jsonl") == [{"check": "x", "error": "nan"}]  # no bare NaN


def test_a_check_with_an_unreadable_result_fails_its_row_and_the_rest_run(tmp_path, monkeypatch):
    gc = _gpu_checks()
    script = tmp_path / "bad_result.py"
    script.write_text("print('RESULT {not json}')\n")
    ok_script = tmp_path / "no_figure.py"
    ok_script.write_text("print('RESULT {\"tokens_per_s\": 1.0}')\n")
    monkeypatch.setattr(gc, "checks", lambda device, quick: [
        ("kernel accuracy", [sys.executable, str(script)], 60),
        ("trainer resume", [sys.executable, str(ok_script)], 60)])
    monkeypatch.setattr(gc, "preflight", lambda *a, **k: gc.Preflight(quiet=True))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the cut handlers stay off pytest
    monkeypatch.setattr(sys, "argv", ["gpu_checks.py", "--device", "cpu", "--jsonl",
                                      str(tmp_path / "rows.jsonl")])
    assert gc.main() == 1
    rows = _rows(tmp_path / "rows.jsonl")[1:]
    assert [r["status"] for r in rows] == ["FAIL (RESULT)", "FAIL (RESULT)"]
    assert "not JSON" in rows[0]["figure"] and "KeyError" in rows[1]["figure"]
