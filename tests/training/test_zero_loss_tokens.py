"""SFT data whose replies --seq-length cuts: no loss token at all is refused before work; a
global batch without one is skipped (logged as null, counted, no update), never reported as
a loss of 0. The same runs check the metrics file's run id and consumed tokens counted
across a --seq-length change on resume."""

import json
import re
import subprocess
import sys

from trainer_runs import REPO, base_args, run_env, train

LONG = "Please read this long question carefully before you answer it. " * 4  # > 64 bytes


def chat_data(root, short_ones):
    """40 conversations whose replies start past byte 200, but the first ``short_ones``."""
    from megatron_jreg.commands.preprocess import main

    lines = []
    for i in range(40):
        user = "Hi?" if i < short_ones else f"{LONG} #{i}"
        lines.append(json.dumps({"messages": [{"role": "user", "content": user},
                                              {"role": "assistant", "content": f"Answer {i}."}]}))
    (root / "chat.jsonl").write_text("\n".join(lines) + "\n")
    prefix = str(root / "chat")
    assert main(["--sft", "--input", str(root / "chat.jsonl"), "--output-prefix", prefix,
                 "--tokenizer-type", "ByteTokenizer", "--workers", "1"]) == 0
    return prefix + "_sft_document"


def sft_args(prefix, **overrides):
    return base_args(prefix, **dict(dict(sft=True, seq_length=64, split="100,0,0",
                                         jreg_lambda=0.5), **overrides))


def test_sft_data_without_a_loss_token_is_refused(tmp_path):
    """Used to train with lm loss 0.000000 and grad norm 0 at every step, save, and exit 0."""
    prefix = chat_data(tmp_path, short_ones=0)
    proc = subprocess.run([sys.executable, "-m", "megatron_jreg.train"] + sft_args(prefix),
                          cwd=REPO, env=run_env(), capture_output=True, text=True, timeout=300)
    err = proc.stderr
    assert proc.returncode == 2, (proc.stdout[-2000:], err[-3000:])
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert ("none of the 40 conversations of the train split has a loss token" in err
            and "--seq-length 64" in err and "raise --seq-length" in err), err
    assert "lm loss" not in proc.stdout


def _console(stdout):
    return {int(m.group(1)): line for line in stdout.splitlines()
            if (m := re.match(r"iteration\s+(\d+)/", line))}


def test_batches_without_loss_tokens_are_skipped_and_tokens_counted(tmp_path):
    """One conversation of 40 has its reply within --seq-length: at most one of a 40-sample
    epoch's 8-sample batches holds it, the others have no loss token."""
    prefix = chat_data(tmp_path, short_ones=1)
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    first = train(sft_args(prefix, train_iters=4, exit_interval=2, save=ckpt,
                           metrics_file=metrics))
    # resumed at a shorter --seq-length: tokens are counted, not samples x the new length
    second = train(sft_args(prefix, train_iters=4, seq_length=48, load=ckpt, save=ckpt,
                            metrics_file=metrics))
    rows = [json.loads(line) for line in open(metrics)]
    assert [r["iteration"] for r in rows] == [1, 2, 3, 4]
    # each line names its run: two runs in one file stay apart
    runs = [r["run_id"] for r in rows]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2], runs
    skipped = [r for r in rows if r["lm_loss"] is None]
    assert len(skipped) >= 3, rows  # a 0/0 loss is null, never 0.0
    assert all(r.get("grad_norm") is None and "jreg_penalty" not in r for r in skipped), skipped
    console = {**_console(first.stdout), **_console(second.stdout)}
    for r in skipped:
        line = console[r["iteration"]]
        assert "skipped 1" in line and "lm loss" not in line, line
        assert "nan" not in line, line  # no step, no gradient norm: not "grad norm nan"
    tokens = int(re.search(r"consumed tokens\s+(\d+)", console[4]).group(1))
    assert tokens == 2 * 8 * 64 + 2 * 8 * 48, console[4]
    done = [line for line in second.stdout.splitlines() if line.startswith("done:")][0]
    skipped_second = sum(r["lm_loss"] is None for r in rows[2:])
    assert f"({skipped_second} skipped: no loss token in the global batch)" in done, done


def test_a_validation_split_without_a_loss_token_turns_validation_off(tmp_path):
    """The train split holds the one short conversation, the validation split only long
    ones: every validation logged a null loss, with no word why."""
    prefix = chat_data(tmp_path, short_ones=1)
    proc = train(sft_args(prefix, train_iters=2, split="50,50,0", eval_interval=1, eval_iters=1))
    said = [line for line in proc.stdout.splitlines() if "validation is off" in line]
    assert said == ["warning: no conversation of the validation split has a loss token within "
                    "--seq-length 64; validation is off"], proc.stdout[-3000:]
    assert "validation at iteration" not in proc.stdout
