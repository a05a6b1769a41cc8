"""Setups that used to fail mid-run with a traceback: one line on stderr, exit 2, no step."""

import subprocess
import sys

import pytest
from trainer_runs import REPO, base_args, run_env

from megatron_jreg.config.model import transformer_engine_available

# the trainer with megatron_jreg._C unimportable: a kernel that failed to build or load
NO_KERNEL = ("import runpy, sys; sys.modules['megatron_jreg._C'] = None; "
             "sys.argv = ['megatron_jreg.train'] + sys.argv[1:]; "
             "runpy.run_module('megatron_jreg.train', run_name='__main__')")


def _run(cmd):
    proc = subprocess.run(cmd, cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def _one_line_before_work(code, out, err, message):
    assert code == 2, (out[-2000:], err[-3000:])
    assert "Traceback" not in err and err.count("\n") == 1 and message in err, err
    assert "iteration" not in out and "lm loss" not in out  # no step ran


def test_jreg_impl_fused_without_the_kernel(demo_data):
    code, out, err = _run([sys.executable, "-c", NO_KERNEL]
                          + base_args(demo_data, jreg_impl="fused"))
    _one_line_before_work(code, out, err,
                          "--jreg-impl fused: the fused kernel is not built for cpu")
    assert "--jreg-impl torch" in err  # the fix
    # auto falls back to the reference and trains
    code, out, err = _run([sys.executable, "-c", NO_KERNEL]
                          + base_args(demo_data, jreg_impl="auto", train_iters=1))
    assert code == 0, err[-3000:]


@pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine is installed")
def test_transformer_impl_transformer_engine_without_te(demo_data):
    code, out, err = _run([sys.executable, "-m", "megatron_jreg.train"]
                          + base_args(demo_data, transformer_impl="transformer_engine"))
    _one_line_before_work(code, out, err, "--transformer-impl transformer_engine needs "
                          "Transformer Engine installed")
