"""A disk that fills up mid-run: one line naming the file, no traceback, no temp files left.

A real full filesystem needs a tmpfs mount (not possible in CI), so output files are opened on
a simulated disk: real files whose raw writes fail with ENOSPC once ``room`` bytes are used,
partially first, as the kernel does. Python's own buffering sits on top, exactly as for a real
file, so a failure can surface in a write, a flush or a close.
"""

import builtins
import errno
import io
import os

import pytest
from preprocess_helpers import make_documents, output_files, write_jsonl

from megatron_jreg.commands.preprocess import main

MESSAGE_END = "; free space or pick another --output-prefix"


class SimulatedDisk:
    """Bytes left on the disk, shared by every file opened on it in this process."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.written = 0
        self.writes_after_full = 0


class _FileOnDisk(io.FileIO):
    def __init__(self, path, mode, disk: SimulatedDisk) -> None:
        super().__init__(path, mode)
        self.disk = disk

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        if self.disk.room <= 0:
            self.disk.writes_after_full += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = super().write(view[: self.disk.room])
        self.disk.room -= n
        self.disk.written += n
        return n


def open_on(disk: SimulatedDisk, directory: str):
    """An ``open`` that puts binary files written under ``directory`` on ``disk``."""
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
        path = os.fspath(file) if isinstance(file, (str, os.PathLike)) else None
        writing = "b" in mode and any(c in mode for c in "wax+")
        if path is None or not writing or not os.path.abspath(path).startswith(directory):
            return real_open(file, mode, *args, **kwargs)
        raw = _FileOnDisk(path, mode.replace("b", ""), disk)
        return io.BufferedRandom(raw) if "+" in mode else io.BufferedWriter(raw)

    return fake_open


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in make_documents(400, seed=5)])


def argv(data, prefix, partitions):
    return ["--input", data, "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer",
            "--append-eod", "--workers", "2", "--chunk-bytes", "2048",
            "--partitions", str(partitions)]


def _bytes_needed(tmp_path, corpus, monkeypatch, partitions) -> int:
    """What a complete run writes (temp and spill files included)."""
    disk = SimulatedDisk(1 << 40)
    out = tmp_path / "probe"
    out.mkdir()
    with monkeypatch.context() as m:
        m.setattr(builtins, "open", open_on(disk, str(out)))
        assert main(argv(corpus, str(out / "out"), partitions)) == 0
    return disk.written


@pytest.mark.parametrize("partitions", [1, 2])
@pytest.mark.parametrize("fraction", [0.0, 0.4, 0.98])
def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, corpus, monkeypatch, capsys,
                                                   partitions, fraction):
    # 0: the first write fails; 0.4: mid-way through the tokens; 0.98: while writing an index
    # (partitions: while merging). Partition processes are forked and fill their own copy of
    # the disk, which only moves where the failure happens.
    needed = _bytes_needed(tmp_path, corpus, monkeypatch, partitions)
    capsys.readouterr()
    out = tmp_path / "run"
    out.mkdir()
    disk = SimulatedDisk(int(needed * fraction))
    monkeypatch.setattr(builtins, "open", open_on(disk, str(out)))
    rc = main(argv(corpus, str(out / "out"), partitions))
    monkeypatch.undo()
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: no space left writing {out}") and err.endswith(MESSAGE_END), err
    assert output_files(out) == []  # no .bin/.idx, no *.tmp-PID, no spill files, no partition dir


def test_abort_deletes_without_writing(tmp_path, monkeypatch):
    # Cleanup on a full disk must not try to flush buffered bytes: that fails again and, before
    # the fix, stopped the cleanup before it deleted anything.
    import numpy

    from megatron_jreg.data.preprocess.writer import IndexedDatasetOutput

    disk = SimulatedDisk(10_000)
    monkeypatch.setattr(builtins, "open", open_on(disk, str(tmp_path)))
    output = IndexedDatasetOutput(str(tmp_path / "out"), numpy.uint16)
    tokens = numpy.arange(3000, dtype=numpy.uint16).tobytes()
    with pytest.raises(OSError) as e:
        for _ in range(10):
            output.writer.add_encoded(tokens, numpy.array([1000, 2000], numpy.int32))
    assert e.value.errno == errno.ENOSPC and e.value.filename.startswith(str(tmp_path))
    writes = disk.writes_after_full
    output.abort()
    assert disk.writes_after_full == writes  # abort only deleted
    assert os.listdir(tmp_path) == []
