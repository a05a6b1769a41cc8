"""Raw text to megatron-core indexed datasets: the work of ``tools/preprocess_data.py``
(its command line: :mod:`megatron_jreg.commands.preprocess`).

:func:`run_preprocess` reads the inputs as line-aligned chunks (``sources``), has a pool of
workers tokenise them (``workers``, ``sft_workers``) and writes the results in input order
(``writer``), so the output is the same bytes for any worker count; ``--partitions N`` runs N
parts in their own processes and merges their datasets in order.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor

from megatron_jreg.atomic_write import check_output_dir, temp_marker
from megatron_jreg.data.preprocess.config import (
    _NO_ROOM,
    PreprocessConfig,
    PreprocessError,
    Terminated,
)
from megatron_jreg.data.preprocess.parent_death import die_with_parent
from megatron_jreg.data.preprocess.progress import Progress, RunStats
from megatron_jreg.data.preprocess.sft_files import metadata_path, write_metadata
from megatron_jreg.data.preprocess.sft_workers import sft_metadata
from megatron_jreg.data.preprocess.sources import (
    Segment,
    iter_chunks,
    resolve_inputs,
    split_into_partitions,
)
from megatron_jreg.data.preprocess.workers import encode_chunk_in_worker, init_worker
from megatron_jreg.data.preprocess.writer import IndexedDatasetOutput
from megatron_jreg.errors import InputError
from megatron_jreg.writer_lock import OutputBusy, output_lock

# A one-line chunk over this many bytes (up to --max-line-bytes) is encoded by the parent
# itself, with the same encoder, after the chunks before it: sent to a worker it would be
# pickled, piped and unpickled both ways, several copies of the line alive at once.
IN_PARENT_BYTES = 1 << 23


def _mp_context() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds; the worker module is spawn-safe where fork is absent.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def _check_output_dir(config: PreprocessConfig) -> None:
    out_dir = os.path.dirname(os.path.abspath(config.output_prefix))
    try:  # made when missing, and proved writable, before any input is read
        check_output_dir(out_dir, "--output-prefix", config.output_prefix)
    except InputError as e:
        raise PreprocessError(str(e)) from None


def _check_outputs(config: PreprocessConfig) -> None:
    """Under the prefix's lock: what exists now is no other run's work in progress."""
    if config.overwrite:
        return
    for path in config.output_paths():
        if os.path.exists(path):
            raise PreprocessError(
                f"{path} already exists; pass --overwrite to replace it or choose another "
                f"--output-prefix"
            )


def _drop_stale_metadata(config: PreprocessConfig) -> None:
    """An SFT run's old metadata goes before its new datasets land: it would vouch for them."""
    if config.sft and os.path.exists(metadata_path(config.output_prefixes()[0])):
        os.unlink(metadata_path(config.output_prefixes()[0]))


def _no_room_error(e: OSError, config: PreprocessConfig) -> PreprocessError | None:
    """A full disk or quota as the one-line error to show; None for other OSErrors."""
    what = _NO_ROOM.get(e.errno)
    if what is None:
        return None
    where = e.filename or os.path.dirname(os.path.abspath(config.output_prefix))
    return PreprocessError(f"{what} writing {where}; free space or pick another --output-prefix")


def _refuse_empty(config: PreprocessConfig, segments: list[Segment], stats: RunStats) -> None:
    """No documents at all: an empty dataset only fails later, in training, naming nothing."""
    if stats.documents or config.allow_empty:
        return
    paths = list(dict.fromkeys(segment.path for segment in segments))
    names = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
    skipped = sum(stats.skipped.values())
    why = f"skipped {skipped} invalid lines, found no good one" if skipped else "empty or blank"
    raise PreprocessError(
        f"no documents in {names} ({why}); check --input, or pass --allow-empty to write an "
        f"empty dataset"
    )


def _encode_stream(
    segments: list[Segment],
    config: PreprocessConfig,
    spec,
    prefixes: list[str],
    dtypes: list,
    workers: int,
    progress: Progress,
    final: bool = True,
    built=None,
) -> RunStats:
    """Tokenise ``segments`` in order into committed datasets at ``prefixes`` (one dtype each).

    ``final`` False (a partition's partial datasets) leaves the no-documents check and stale
    metadata to the caller (a partition may be empty when the whole input is not). ``built``:
    the encoder of ``spec``, for forked workers to inherit (None: each worker builds its own).
    """
    # Each worker parses, validates and tokenises a whole chunk per message and sends back
    # packed token buffers; the parent takes results in submission order and only writes
    # bytes. At most 4 * workers chunks are in flight, so memory does not grow with the corpus.
    stats = RunStats()
    outputs = []
    pending: deque = deque()
    window = max(2, 4 * workers)

    def consume() -> None:
        path, first_line, num_bytes, future = pending.popleft()
        record(path, first_line, num_bytes, future.result())

    def record(path, first_line, num_bytes, result) -> None:
        if result.error is not None:
            line, message = result.error
            raise PreprocessError(
                f"{path}:{first_line + line}: {message}; fix it or pass --skip-invalid"
            )
        for output, encoded in zip(outputs, result.keys):
            output.writer.add_encoded(
                encoded.tokens, encoded.sequence_lengths, encoded.sequences_per_document
            )
        stats.documents += result.documents
        stats.tokens += result.tokens
        stats.bytes += num_bytes
        stats.skipped.update(result.skipped)
        stats.counts.update(result.counts)
        for reason, line in result.first_skipped.items():
            stats.first_skipped.setdefault(reason, f"{path}:{first_line + line}")
        progress.update(stats, result.documents)

    # ProcessPoolExecutor, not multiprocessing.Pool: a worker that dies (OOM killer) breaks
    # the executor with an error instead of leaving the parent waiting forever.
    executor = ProcessPoolExecutor(
        workers, mp_context=_mp_context(), initializer=init_worker,
        initargs=(spec, os.getpid(), built),
    )
    try:
        try:
            for prefix, dtype in zip(prefixes, dtypes):
                outputs.append(IndexedDatasetOutput(prefix, dtype))
            for segment in segments:
                for chunk in iter_chunks(segment, config.chunk_bytes, config.read_keys,
                                         config.max_line_bytes):
                    if chunk.num_lines == 1 and chunk.num_bytes > IN_PARENT_BYTES:
                        while pending:  # results stay in input order
                            consume()
                        if built is None:
                            built = spec.build()
                        where = (segment.path, chunk.first_line, chunk.num_bytes)
                        # encode_chunk takes the chunk's bytes: drop our name for them too
                        record(*where, built.encode_chunk(chunk, segment.kind))
                        continue
                    future = executor.submit(encode_chunk_in_worker, chunk)
                    pending.append((segment.path, chunk.first_line, chunk.num_bytes, future))
                    if len(pending) >= window:
                        consume()
            while pending:
                consume()
        finally:
            # On failure only the few chunks already running finish; queued ones are dropped.
            executor.shutdown(wait=True, cancel_futures=True)
        if final:
            _refuse_empty(config, segments, stats)
            _drop_stale_metadata(config)
        for output in outputs:
            output.commit()
    except BaseException:
        for output in outputs:
            output.abort()
        raise
    return stats


def _run_partition(index, segments, config, spec, prefixes, dtypes, workers, parent_pid,
                   conn, built) -> None:
    """Child process body: one partition into committed partial datasets; reports back."""
    die_with_parent(parent_pid)
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        progress = Progress(config.log_interval, stream=_NotATty(sys.stderr),
                            label=f"[partition {index}] ")
        stats = _encode_stream(segments, config, spec, prefixes, dtypes, workers, progress,
                               final=False, built=built)
        conn.send(("ok", stats))
    except (PreprocessError, InputError) as e:
        conn.send(("error", str(e)))
    except OSError as e:
        no_room = _no_room_error(e, config)
        # the error itself (its number and file), for the parent to raise: the command
        # reports an OS error of writing in one line (errors.write_error_line)
        conn.send(("error", str(no_room)) if no_room
                  else ("oserror", (e.errno, e.strerror, e.filename)))
    except KeyboardInterrupt:
        conn.send(("interrupted", "ctrl-c"))
    except Terminated:
        conn.send(("interrupted", "sigterm"))
    except BaseException as e:  # report, then let the parent clean up
        conn.send(("crash", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


class _NotATty:
    """Partitions log plain lines: several tqdm bars on one terminal garble each other."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        return self._stream.write(s)

    def flush(self) -> None:
        self._stream.flush()


def _encode_partitioned(config, spec, segments, dtypes, progress, built) -> RunStats:
    # The input is cut into N contiguous line-aligned parts, each processed by its own process
    # (workers // N workers) into a partial dataset; the parts are merged in order with
    # add_index, which gives the same bytes as one pass.
    groups = split_into_partitions(segments, config.partitions)
    workers = max(1, config.workers // len(groups))
    tmp_dir = f"{config.output_prefix}_partitions{temp_marker()}"
    os.mkdir(tmp_dir)
    ctx = _mp_context()
    procs = []
    try:
        for i, group in enumerate(groups):
            part_prefixes = [os.path.join(tmp_dir, f"part{i:04d}_{k}") for k in range(len(dtypes))]
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_run_partition,
                args=(i, group, config, spec, part_prefixes, dtypes, workers, os.getpid(), send,
                      built),
            )
            proc.start()
            send.close()
            procs.append((proc, recv, part_prefixes))
        stats = RunStats()
        failure = None
        for i, (proc, recv, _) in enumerate(procs):
            try:
                status, payload = recv.recv()
            except EOFError:
                status, payload = "crash", f"partition {i} died (exit code {proc.exitcode})"
            proc.join()
            if status == "ok":
                stats.merge(payload)
            elif failure is None:  # report the earliest partition's problem, as one pass would
                failure = (status, payload)
        if failure is not None:
            if failure[0] == "interrupted":  # the signal reached a partition first
                raise KeyboardInterrupt if failure[1] == "ctrl-c" else Terminated()
            if failure[0] == "error":
                raise PreprocessError(failure[1])
            if failure[0] == "oserror":
                raise OSError(*failure[1])
            raise RuntimeError(failure[1])
        progress.update(stats, stats.documents)
        _refuse_empty(config, segments, stats)
        _drop_stale_metadata(config)
        for k, prefix in enumerate(config.output_prefixes()):
            output = IndexedDatasetOutput(prefix, dtypes[k])
            try:
                for _, _, part_prefixes in procs:
                    output.writer.add_index(part_prefixes[k])
                output.commit()
            except BaseException:
                output.abort()
                raise
        return stats
    finally:
        for proc, _, _ in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
        shutil.rmtree(tmp_dir, ignore_errors=True)


def run_preprocess(config: PreprocessConfig) -> RunStats:
    """Validate everything cheap first, then tokenise; raises PreprocessError on user errors.

    The lock of ``--output-prefix`` is held for the whole run: of two runs on one prefix the
    second is refused, so no .bin, .idx or SFT metadata of one lands beside the other's."""
    start = time.perf_counter()
    _check_output_dir(config)
    try:
        with output_lock(config.output_prefix, "--output-prefix"):
            stats = _run_locked(config)
    except OutputBusy as e:  # raised only by taking the lock
        raise PreprocessError(str(e)) from None
    stats.seconds = time.perf_counter() - start
    return stats


def _run_locked(config: PreprocessConfig) -> RunStats:
    _check_outputs(config)
    try:
        segments = resolve_inputs(config.input, config.input_format)
    except InputError as e:
        raise PreprocessError(str(e)) from None
    try:
        # Built here first so a bad tokenizer, chat template or missing nltk fails once,
        # clearly, instead of in every worker; forked workers then inherit it.
        spec = config.encoder_spec()
        encoder = spec.build()
    except (FileNotFoundError, ValueError, RuntimeError, ImportError) as e:
        raise PreprocessError(str(e)) from None
    built = encoder if _mp_context().get_start_method() == "fork" else None
    progress = Progress(config.log_interval)
    try:
        if config.partitions > 1:
            stats = _encode_partitioned(config, spec, segments, encoder.dtypes, progress, built)
        else:
            stats = _encode_stream(segments, config, spec, config.output_prefixes(),
                                   encoder.dtypes, config.workers, progress, built=built)
        if config.sft:
            write_metadata(config.output_prefixes()[0], sft_metadata(spec, encoder, stats))
    except InputError as e:
        raise PreprocessError(str(e)) from None
    except OSError as e:
        no_room = _no_room_error(e, config)
        if no_room is None:
            raise
        raise no_room from None
    finally:
        progress.close()
    return stats


def _raise_terminated(signum, frame) -> None:
    raise Terminated()
