"""eval_downstream and compare_seeds on inputs a fault-injection pass found wrong: a batch
size of 0 or below, lm-eval's forked bootstrap pool terminated under our SIGTERM handler,
a checkpoint whose SentencePiece tokenizer was retrained in place, a report with a NaN
score."""

import json
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from checkpoint_runs import REPO, run_env, run_tool
from downstream_tasks import CHOICE, write_tasks

from megatron_jreg.downstream.evaluate import _batch_size
from megatron_jreg.errors import InputError

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")


def env():
    return dict(run_env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONPATH=REPO,
                TOKENIZERS_PARALLELISM="false")


def tool(script, argv):
    return run_tool(script, argv, timeout=600, check=False, env=env())


def one_line_error(proc, *words):
    # datasets' progress lines the first time it reads a local task's data file are not ours
    # (nor the tool's "evaluating" line: the pin is checked when the checkpoint is exported)
    lines = [line for line in proc.stderr.strip().splitlines()
             if not line.startswith("Generating test split") and not line.endswith(CHOICE)]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1, lines
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


# ---- --batch-size ----------------------------------------------------------------------------


@pytest.mark.parametrize("value, want", [("8", 8), ("1", 1), ("auto", "auto"),
                                         ("auto:4", "auto:4"), ("AUTO", "auto")])
def test_batch_size_values_lm_eval_takes(value, want):
    assert _batch_size(value) == want


@pytest.mark.parametrize("value", ["0", "-3", "auto:0", "auto:x", "2.5", "big", ""])
def test_batch_size_values_refused(value):
    with pytest.raises(InputError, match=f"--batch-size {value}: expected an integer >= 1"):
        _batch_size(value)


@pytest.mark.parametrize("value", ["0", "-3"])
def test_eval_downstream_refuses_a_batch_size_below_one(tiny_hf_model, tmp_path, value):
    """Was: exit 0 and a full report (lm-eval took the size without a word)."""
    tasks = write_tasks(str(tmp_path / "tasks"), n=4)
    proc = tool("eval_downstream.py", ["--hf-model", tiny_hf_model, "--tasks", CHOICE,
                                       "--include-path", tasks, "--no-cache",
                                       f"--batch-size={value}"])
    one_line_error(proc, f"--batch-size {value}", "integer >= 1", "auto")
    assert proc.stdout == ""


# ---- SIGTERM in forked children ----------------------------------------------------------------


FORKED = """
import multiprocessing, os, signal, sys, time
from megatron_jreg.downstream.evaluate import _signals_as_interrupt_here


def square(x):
    return x * x


def wait(ready):
    ready.set()
    time.sleep(60)


if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")
    before = signal.getsignal(signal.SIGTERM)
    with _signals_as_interrupt_here():
        pool = ctx.Pool(3)
        assert pool.map_async(square, range(6)).get(60) == [0, 1, 4, 9, 16, 25]
        pool.terminate()  # as lm-eval's pool exit does (which workers it signals: a race)
        pool.join()
        # the same, deterministically: a forked child busy in its work gets SIGTERM
        ready = ctx.Event()
        child = ctx.Process(target=wait, args=(ready,))
        child.start()
        assert ready.wait(60)
        child.terminate()
        child.join(60)
        try:  # the parent still turns SIGTERM into KeyboardInterrupt(SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            stopped = None
        except KeyboardInterrupt as err:
            stopped = str(err)
    print(child.exitcode, stopped, signal.getsignal(signal.SIGTERM) == before)
"""


def test_forked_pool_terminated_under_the_handler_prints_no_traceback(tmp_path):
    """lm-eval bootstraps its stderrs in a forked multiprocessing pool and ends it with
    terminate(): the workers inherited the SIGTERM -> KeyboardInterrupt handler and those
    the SIGTERM reached printed 'Process ForkPoolWorker-N ... KeyboardInterrupt: SIGTERM'.
    In a fresh process: forking the test process (torch's threads) may deadlock a worker."""
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr, proc.stderr
    # the child ended by the signal's default action; the parent interrupted; restored after
    assert proc.stdout.split() == [str(-signal.SIGTERM), "SIGTERM", "True"], proc.stdout


# ---- --tokenizer-model -------------------------------------------------------------------------


def test_cache_key_follows_the_tokenizer_model_flag(tmp_path):
    from megatron_jreg.downstream.cache import checkpoint_identity

    sp, kept = tmp_path / "tok.model", tmp_path / "kept.model"
    sp.write_bytes(b"retrained")
    kept.write_bytes(b"trained with")
    data = SimpleNamespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=str(sp))
    it_dir = tmp_path / "iter"
    it_dir.mkdir()
    plain = checkpoint_identity(str(it_dir), str(tmp_path), 1, data)
    given = checkpoint_identity(str(it_dir), str(tmp_path), 1, data, tokenizer_model=str(kept))
    assert given != plain
    kept.write_bytes(b"another")  # the content of the file given, not its path
    assert checkpoint_identity(str(it_dir), str(tmp_path), 1, data,
                               tokenizer_model=str(kept)) != given


@pytest.fixture(scope="module")
def sp_checkpoint(tmp_path_factory):
    """A 3-step run with a SentencePiece tokenizer at a path the test may retrain in place."""
    from checkpoint_runs import make_dataset, train

    root = tmp_path_factory.mktemp("sp_downstream")
    data = make_dataset(str(root))
    corpus = str(root / "corpus.jsonl")
    sp = str(root / "sp")
    run_tool("train_tokenizer.py", ["--input", corpus, "--model-prefix", sp,
                                    "--vocab-size", "420", "--overwrite"])
    save = train(data, str(root / "ck"), tokenizer_type="GPTSentencePieceTokenizer",
                 tokenizer_model=sp + ".model", vocab_size=None)
    return save, sp + ".model", corpus, write_tasks(str(root / "tasks"), n=8)


def test_eval_downstream_takes_the_tokenizer_model_the_refusal_names(sp_checkpoint, tmp_path):
    """Was: the refusal of a tokenizer retrained in place said "pass that tokenizer with
    --tokenizer-model", which eval_downstream did not know (unrecognized arguments)."""
    save, sp, corpus, tasks = sp_checkpoint
    kept = str(tmp_path / "kept.model")
    shutil.copyfile(sp, kept)
    common = ["--load", save, "--tasks", CHOICE, "--include-path", tasks, "--limit", "4",
              "--batch-size", "4", "--cache-dir", tmp_path / "cache"]
    try:
        run_tool("train_tokenizer.py", ["--input", corpus, "--model-prefix",
                                        sp[:-len(".model")], "--vocab-size", "400", "--overwrite"])
        proc = tool("eval_downstream.py", common)
        one_line_error(proc, f"the run's tokenizer {sp} is now", "(400 ids", "(420 ids",
                       "--tokenizer-model")
        # the tokenizer the run trained with, kept elsewhere: no word
        proc = tool("eval_downstream.py", [*common, "--tokenizer-model", kept, "--json",
                                           tmp_path / "kept.json"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "as asked" not in proc.stderr and "Traceback" not in proc.stderr
        assert json.loads((tmp_path / "kept.json").read_text())["tasks"][CHOICE]["samples"] == 4
        # another tokenizer, used as asked: one warning, and not the kept one's cache entry
        proc = tool("eval_downstream.py", [*common, "--tokenizer-model", sp])
        assert proc.returncode == 0, proc.stderr[-3000:]
        warned = [line for line in proc.stderr.splitlines() if "using it as asked" in line]
        assert len(warned) == 1, proc.stderr
        assert "evaluating" in proc.stderr, proc.stderr
        # the kept tokenizer again: read from the cache
        proc = tool("eval_downstream.py", [*common, "--tokenizer-model", kept])
        assert proc.returncode == 0 and "evaluating" not in proc.stderr, proc.stderr[-3000:]
    finally:
        shutil.copyfile(kept, sp)


def test_tokenizer_model_errors(tiny_hf_model, sp_checkpoint, tmp_path):
    save, _, _, tasks = sp_checkpoint
    proc = tool("eval_downstream.py", ["--hf-model", tiny_hf_model, "--tokenizer-model",
                                       tmp_path, "--tasks", CHOICE, "--include-path", tasks])
    one_line_error(proc, "--tokenizer-model applies to --load")
    proc = tool("eval_downstream.py", ["--load", save, "--tokenizer-model", tmp_path / "none",
                                       "--tasks", CHOICE, "--include-path", tasks])
    one_line_error(proc, f"--tokenizer-model {tmp_path / 'none'}: no such file")


# ---- compare_seeds on a report with a score that is not a number ---------------------------------


def _report(seed, value):
    return {"model": f"s{seed}", "seed": seed,
            "tasks": {"boolq": {"metric": "acc", "value": value, "stderr": 1.0}}}


@pytest.mark.parametrize("bad, shown", [("NaN", "nan"), ("Infinity", "inf"), ("null", "missing")])
def test_compare_seeds_names_a_score_that_is_not_finite(tmp_path, bad, shown):
    """Was: "the scores are too large to average in floating point (overflow); check the
    CSV's values" for a JSON report with a NaN score."""
    base = tmp_path / "a.json"
    base.write_text(json.dumps([_report(1, 60.0), _report(2, 61.0), _report(3, 59.0)]))
    jreg = tmp_path / "b.json"
    text = json.dumps([_report(1, 62.0), _report(2, 0.5), _report(3, 60.0)])
    jreg.write_text(text.replace("0.5", bad))
    proc = tool("compare_seeds.py", ["--baseline", base, "--jreg", jreg])
    line = one_line_error(proc, f"--jreg {jreg}: task boolq, seed 2: the score is {shown}",
                          "not a finite number")
    assert "overflow" not in line and "CSV" not in line


def test_overflow_message_does_not_name_a_csv():
    from megatron_jreg.stats.seed_stats import one_sided_t_test

    with pytest.raises(InputError, match="overflow") as err:
        one_sided_t_test([1e308, 1e308, -1e308])
    assert "CSV" not in str(err.value)
