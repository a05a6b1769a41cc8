"""Every command turns an OS error of writing into one line at one place
(``commands.exit_codes.run_command``, with ``errors.write_error_line``): the file, the
cause and the fix, exit 2, however a library wrapped the error, while any other error keeps
its traceback.

The tools' own runs against a real file size limit, a full tmpfs and a read-only file
system are in tests/training/test_write_errors_training.py,
tests/analysis/test_write_errors_convert.py and tests/data/test_write_errors_data.py; here
each form the error arrives in, and a real EACCES (as root too: tests/unwritable.py).
"""

import errno
import os

import pytest

from megatron_jreg.commands.exit_codes import USAGE, run_command
from megatron_jreg.errors import write_error_at, write_error_line
from unwritable import unwritable_dir

FULL = "the disk is full; free space or write elsewhere"


@pytest.mark.parametrize("code,text", [
    (errno.ENOSPC, "cannot write /o/f: " + FULL),
    (errno.EDQUOT, "cannot write /o/f: the disk quota is used up; free space or write elsewhere"),
    (errno.EROFS, "cannot write /o/f: the file system is read-only; write elsewhere, or "
                  "remount it read-write"),
    (errno.EACCES, "/o/f: permission denied; give this user access to it or use another path"),
    (errno.EPERM, "/o/f: operation not permitted; give this user access to it or use another path"),
])
def test_each_cause_has_its_fix(code, text):
    assert write_error_line(OSError(code, os.strerror(code), "/o/f")) == text


def test_the_file_size_limit_names_the_limit():
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    line = write_error_line(OSError(errno.EFBIG, "File too large", "/o/f"))
    limit = "" if soft == resource.RLIM_INFINITY else f": {soft} bytes"
    assert line == (f"cannot write /o/f: the file size limit (ulimit -f{limit}) was reached; "
                    "raise it (`ulimit -f unlimited`) or write smaller files")


def test_the_error_is_found_however_it_was_wrapped():
    from torch.distributed.checkpoint.api import CheckpointException

    # megatron-core: the writer's OSError as text, in a CheckpointException of the ranks
    worker = RuntimeError(
        "Worker failure: [Errno 28] No space left on device: '/c/it/__0_0.distcp'")
    wrapped = CheckpointException("write", {0: (worker, None)})
    assert write_error_line(wrapped) == "cannot write /c/it/__0_0.distcp: " + FULL
    # Rust (tokenizers, safetensors): the number only; the command's output is named
    rust = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_error_line(rust, "/out") == "cannot write /out: " + FULL
    assert write_error_line(rust) == "a write failed: " + FULL
    # raised from, or during the handling of, an OS error: the first that names a file
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")  # a close's flush: no file
        except OSError:
            raise RuntimeError("save failed") from OSError(errno.ENOSPC, "x", "/named")
    except RuntimeError as outer:
        assert write_error_line(outer) == "cannot write /named: " + FULL


@pytest.mark.parametrize("err", [
    ValueError("a bug"), FileNotFoundError(errno.ENOENT, "No such file", "/x"),
    PermissionError(errno.EPERM, "Operation not permitted"),  # os.kill, prctl: no file
    RuntimeError("unexpected pos 704 vs 598"),  # a number lost: told by write_error_at
])
def test_other_errors_are_not_write_errors(err):
    assert write_error_line(err) is None


def test_run_command_says_one_line_and_other_errors_keep_their_traceback(tmp_path, capsys):
    place = unwritable_dir(tmp_path)  # a real EACCES: root too may not create files there

    def write():
        with open(os.path.join(place, "out.json"), "w") as f:
            f.write("{}")
        return 0

    assert run_command(write, prefix="tool: error", output="/unused") == USAGE
    err = capsys.readouterr().err
    assert err == (f"tool: error: {place}/out.json: permission denied; give this user access "
                   "to it or use another path\n")
    with pytest.raises(ValueError):
        run_command(lambda: int("x"))
    with pytest.raises(KeyboardInterrupt):
        run_command(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_what_a_failed_write_left_tells_a_lost_number(tmp_path):
    """torch's zip writer loses the OS error's number ("unexpected pos"): a file at the
    file size limit is EFBIG (a full or read-only file system: tests/training's tmpfs runs);
    else nothing is claimed."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    short = tmp_path / "common.pt"
    short.write_bytes(b"x" * 4096)
    assert write_error_at(str(tmp_path)) is None
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        found = write_error_at(str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (found.errno, found.filename) == (errno.EFBIG, str(short))
