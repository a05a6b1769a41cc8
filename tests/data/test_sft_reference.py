"""SFT datasets and training samples against references written by hand (sft_reference.py:
the tulu rendering, byte tokens, the loss mask on each assistant content and its EOS, and
next-token samples): the dataset of whole conversations, of conversations cut by
``--max-seq-length``, and the samples SFT training reads from it. Also the datasets as
written (any worker count, JSONL or Parquet, the demo chats, the README's commands) and as
read (the reader's errors)."""

import json
import os
import re
import shutil

import pytest

from megatron_jreg.commands.preprocess import main
from megatron_jreg.data.datasets.sft import SFTDataset
from megatron_jreg.data.datasets.sft_samples import build_sft_samples
from megatron_jreg.data.preprocess.demo_corpus import DemoCorpusConfig, write_demo_corpus
from megatron_jreg.errors import InputError
from sft_reference import (
    BYTE_EOS,
    CONVERSATIONS,
    byte_tulu,
    reference_sample,
    run_sft,
    sample_order,
    tulu_text,
)

BYTE = ("--tokenizer-type", "ByteTokenizer")
LENGTHS = [len(byte_tulu(m)[0]) for m in CONVERSATIONS]
# conversation 0 cut so that its last target is the EOS ending its answer; the longest whole
CUT_AT_EOS, WHOLE = byte_tulu(CONVERSATIONS[0])[0].index(BYTE_EOS), max(LENGTHS)


def assistant_runs(sample):
    """The labels of each maximal run of loss-masked positions: what the loss trains on."""
    runs, current = [], []
    for label, counted in zip(sample["labels"].tolist(), sample["loss_mask"].tolist()):
        if counted:
            current.append(label)
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


@pytest.mark.parametrize("seq_length", [CUT_AT_EOS, WHOLE], ids=["cut", "whole"])
def test_training_samples_are_the_reference(tmp_path, capsys, seq_length):
    """build_sft_samples (what --sft training reads), two epochs: sample ``i`` is the
    conversation of the seeded order; position p reads its token p and predicts token
    p + 1, in the loss exactly when token p + 1 is an assistant content token or the EOS
    after it; padding after the conversation; the padding waste is the padding's share."""
    rc, _, prefix = run_sft(tmp_path, CONVERSATIONS, *BYTE)
    assert rc == 0
    dataset = SFTDataset(prefix + "_sft_document")
    references = [byte_tulu(m) for m in CONVERSATIONS]
    for i, (ids, mask) in enumerate(references):
        assert dataset[i]["tokens"].tolist() == ids and dataset[i]["loss_mask"].tolist() == mask
    n, seed, pad = len(CONVERSATIONS), 3, 258
    train, valid, waste = build_sft_samples([prefix + "_sft_document"], "100,0,0", seq_length,
                                            seed, 2 * n, 0, pad_id=pad)
    assert valid is None and len(train) == 2 * n
    order = [sample_order(i, n, seed) for i in range(2 * n)]
    assert sorted(order[:n]) == sorted(order[n:]) == list(range(n)) and order[:n] != order[n:]
    for i, conversation in enumerate(order):
        got = train[i]
        for key, want in reference_sample(*references[conversation], seq_length, pad).items():
            assert got[key].tolist() == want.tolist(), (i, conversation, key)
        assert got["position_ids"].tolist() == list(range(seq_length))
        # read off the sample: the loss trains on each answer and its EOS, as far as it fits
        answers = [list(m["content"].encode()) + [BYTE_EOS]
                   for m in CONVERSATIONS[conversation] if m["role"] == "assistant"]
        if seq_length == WHOLE:
            assert assistant_runs(got) == answers
        elif conversation == 0:
            assert assistant_runs(got) == answers and got["labels"][-1] == BYTE_EOS
    used = sum(min(length - 1, seq_length) for length in LENGTHS)
    assert waste == pytest.approx(1 - used / (n * seq_length), rel=1e-12)


def test_workers_and_partitions_write_identical_bytes(tmp_path, capsys):
    chat = str(tmp_path / "chat.jsonl")
    write_demo_corpus(DemoCorpusConfig(output=chat, chat=True, max_docs=300))
    outputs = {}
    for name, flags in (("w1", []), ("w2", ["--workers", "2"]),
                        ("p2", ["--workers", "2", "--partitions", "2"])):
        prefix = str(tmp_path / name)
        assert main(["--sft", "--input", chat, "--output-prefix", prefix, "--tokenizer-type",
                     "ByteTokenizer", "--chunk-bytes", "2048", *flags]) == 0
        base = prefix + "_sft_document"
        outputs[name] = [open(base + ext, "rb").read() for ext in
                         (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", ".json")]
    assert outputs["w1"] == outputs["w2"] == outputs["p2"]
    assert len(SFTDataset(str(tmp_path / "w1_sft_document"))) == 300
    # nothing but the inputs and the three runs' five files each: no temporary names left
    assert len(os.listdir(tmp_path)) == 1 + 3 * 5


def test_overlong_conversations_are_skipped_or_truncated(tmp_path, capsys):
    lengths = LENGTHS  # tokens of each whole conversation
    limit = sorted(lengths)[1]  # two fit; conversation 0's answer starts before the limit
    header = len(tulu_text(CONVERSATIONS[3][:1], "").encode()) + len("<|assistant|>\n")
    long_answer_later = CONVERSATIONS[0][:2] + [
        {"role": "user", "content": "x" * limit}, {"role": "assistant", "content": "late"}]
    records = CONVERSATIONS + [long_answer_later]
    rc, _, prefix = run_sft(tmp_path, records, "--tokenizer-type", "ByteTokenizer",
                            "--max-seq-length", str(limit), "--overwrite")
    assert rc == 0 and header < limit
    skipped = SFTDataset(prefix + "_sft_document")
    assert sorted(skipped.lengths.tolist()) == sorted(n for n in lengths if n <= limit)
    counts = skipped.metadata["counts"]
    assert counts["skipped_by_reason"] == {"longer than --max-seq-length": 3}
    assert skipped.metadata["overlong"] == "skip" and skipped.metadata["max_seq_length"] == limit

    rc, _, prefix = run_sft(tmp_path, records, "--tokenizer-type", "ByteTokenizer",
                            "--max-seq-length", str(limit), "--overlong", "truncate",
                            name="trunc")
    assert rc == 0
    cut = SFTDataset(prefix + "_sft_document")
    assert cut.lengths.tolist() == [min(n, limit) for n in lengths]  # the last one is dropped
    counts = cut.metadata["counts"]
    assert counts["truncated"] == sum(n > limit for n in lengths)
    assert counts["skipped_by_reason"] == {"no assistant token within --max-seq-length": 1}
    for i, messages in enumerate(CONVERSATIONS):  # the first --max-seq-length tokens
        ids, mask = byte_tulu(messages)
        assert cut[i]["tokens"].tolist() == ids[:limit]
        assert cut[i]["loss_mask"].tolist() == mask[:limit]
    assert "truncated 2" in capsys.readouterr().out


def test_reader_errors_name_the_file_and_the_fix(tmp_path, capsys):
    rc, _, prefix = run_sft(tmp_path, CONVERSATIONS, "--tokenizer-type", "ByteTokenizer")
    rc2, _, other = run_sft(tmp_path, CONVERSATIONS[:2], "--tokenizer-type", "ByteTokenizer",
                            name="other")
    assert rc == rc2 == 0
    ds_prefix = prefix + "_sft_document"
    with pytest.raises(InputError, match=r"pass the dataset prefix .*out_sft_document"):
        SFTDataset(prefix)
    work = tmp_path / "work"
    work.mkdir()
    names = [os.path.basename(ds_prefix) + ext for ext in
             (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", ".json")]

    def fresh():
        for name in os.listdir(work):
            os.unlink(work / name)
        for name in names:
            shutil.copy(tmp_path / name, work / name)
        return str(work / os.path.basename(ds_prefix))

    for missing in names:
        p = fresh()
        os.unlink(work / missing)
        with pytest.raises(InputError, match=re.escape(missing) + r" does not exist; rebuild it "
                           r"with tools/preprocess_data.py --sft"):
            SFTDataset(p)
    p = fresh()  # another run's mask: its lengths do not fit these tokens
    for ext in (".bin", ".idx"):
        shutil.copy(other + "_sft_document_loss_mask" + ext, p + "_loss_mask" + ext)
    with pytest.raises(InputError, match="loss mask's sequence lengths differ.*--sft"):
        SFTDataset(p)
    p = fresh()  # another run's metadata
    shutil.copy(other + "_sft_document.json", p + ".json")
    with pytest.raises(InputError, match="lists 2 conversations but the data holds 4"):
        SFTDataset(p)
    p = fresh()
    with open(p + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(InputError, match="come from different runs"):
        SFTDataset(p)
    ds = SFTDataset(fresh())
    with pytest.raises(IndexError):
        ds[4]
    assert ds[-1]["tokens"].tolist() == ds[3]["tokens"].tolist()


def test_demo_chats_are_deterministic_short_and_valid(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert write_demo_corpus(DemoCorpusConfig(output=str(a), chat=True))[0] == 500
    write_demo_corpus(DemoCorpusConfig(output=str(b), chat=True))
    assert a.read_bytes() == b.read_bytes()
    records = [json.loads(line) for line in a.read_text().splitlines()]
    turns = [sum(m["role"] == "assistant" for m in r["messages"]) for r in records]
    assert set(turns) == {1, 2, 3}
    assert 0.1 < sum(r["messages"][0]["role"] == "system" for r in records) / 500 < 0.5
    assert len({json.dumps(r["messages"]) for r in records}) > 450  # varied, not repeats
    assert all([m["role"] for m in r["messages"] if m["role"] != "system"]
               == ["user", "assistant"] * t for r, t in zip(records, turns))
    prefix = str(tmp_path / "demo")
    assert main(["--sft", "--input", str(a), "--output-prefix", prefix,
                 "--tokenizer-type", "ByteTokenizer"]) == 0
    ds = SFTDataset(prefix + "_sft_document")
    assert len(ds) == 500 and ds.lengths.max() <= 256  # the tiny SFT run trains at 256
    assert ds.metadata["counts"]["skipped"] == 0
    few = tmp_path / "few.jsonl"
    assert write_demo_corpus(DemoCorpusConfig(output=str(few), chat=True, max_docs=20))[0] == 20
    assert few.read_text().splitlines() == a.read_text().splitlines()[:20]


def test_parquet_messages_column_gives_the_same_dataset(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    clean = [[{"role": m["role"], "content": m["content"]} for m in c] for c in CONVERSATIONS]
    pq.write_table(pa.table({"messages": clean}), tmp_path / "chat.parquet")
    rc, _, prefix = run_sft(tmp_path, clean, "--tokenizer-type", "ByteTokenizer")
    assert rc == 0
    assert main(["--sft", "--input", str(tmp_path / "chat.parquet"), "--output-prefix",
                 str(tmp_path / "pq"), "--tokenizer-type", "ByteTokenizer"]) == 0
    for ext in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx"):
        assert (tmp_path / f"pq_sft_document{ext}").read_bytes() == open(
            f"{prefix}_sft_document{ext}", "rb").read()


def test_readme_sft_data_commands_run_as_written(tmp_path):
    """The README's two SFT data lines, read from the README, run in an empty directory."""
    import re
    import shlex
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(repo, "README.md"), encoding="utf-8").read()
    section = readme[readme.index("### SFT data"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    lines = [line for line in lines if line]
    assert len(lines) == 2 and lines[1].startswith("python tools/preprocess_data.py --sft"), lines
    os.symlink(os.path.join(repo, "tools"), tmp_path / "tools")
    env = dict(os.environ, PYTHONPATH=repo)
    for line in lines:
        argv = shlex.split(line)
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (line, proc.stderr[-2000:])
    dataset = SFTDataset(str(tmp_path / "chat_sft_document"))
    assert len(dataset) == 500 and dataset.metadata["chat_template_name"] == "tulu"
