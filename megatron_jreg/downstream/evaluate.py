"""The work of ``tools/eval_downstream.py``: models, tasks, cache, outputs (its command
line: :mod:`megatron_jreg.commands.eval_downstream`).

:func:`run` loads the tasks before any model (a typo or an uncached dataset fails first), then
evaluates each model with lm-eval (``harness``) on the tasks missing from the cache (``cache``).
A checkpoint (``--load``) is exported to a temporary Hugging Face directory in a child process;
``--hf-model`` takes a directory, a cached hub id or a ``.gguf`` file. Input problems raise
:class:`InputError`: one line on stderr, exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import threading
from typing import List, Optional

from megatron_jreg import hf_models
from megatron_jreg.atomic_write import (
    check_output_dir,
    check_output_path,
    signals_as_interrupt,
)
from megatron_jreg.checkpoint.faults import TOOLS, phrase
from megatron_jreg.checkpoint.run_configs import checkpoint_sources
from megatron_jreg.checkpoint.to_hf import convert
from megatron_jreg.downstream import cache as cache_mod
from megatron_jreg.downstream import harness
from megatron_jreg.downstream.report import DownstreamReport, TaskScore
from megatron_jreg.downstream.settings import PROG, DownstreamConfig
from megatron_jreg.downstream.tasks import pick_metric, resolve_tasks
from megatron_jreg.errors import InputError, UserError
from megatron_jreg.platform.device import resolve_device


@dataclasses.dataclass
class ModelEntry:
    label: str
    kind: str  # "load" or "hf_model"
    path: str  # as given: the report's source
    iteration: Optional[int] = None
    seed: Optional[int] = None
    identity: dict = dataclasses.field(default_factory=dict)
    local: Optional[str] = None  # --hf-model: the directory or .gguf file it resolved to


def _entries(args) -> List[ModelEntry]:
    paths, kind = (args.load, "load") if args.load else (args.hf_model, "hf_model")
    if not paths:
        raise InputError("no model: give --load CKPT ... or --hf-model DIR ...")
    if args.iteration is not None and kind != "load":
        raise InputError("--iteration applies to --load CKPT only")
    if args.tokenizer_model is not None:
        if kind != "load":
            raise InputError("--tokenizer-model applies to --load CKPT only (an --hf-model "
                             "carries its tokenizer)")
        if not os.path.exists(args.tokenizer_model):
            raise InputError(f"--tokenizer-model {args.tokenizer_model}: no such file or "
                             "directory; give the run's tokenizer model")
    labels = args.label or []
    if labels and len(labels) != len(paths):
        raise InputError(f"{len(labels)} --label for {len(paths)} models; give one per model")
    names = [hf_models.default_label(p) for p in paths]
    if len(set(names)) < len(names):
        names = [os.path.normpath(p) for p in paths]
    entries = []
    for path, name in zip(paths, labels or names):
        if kind == "hf_model":
            # a directory, a cached hub id's snapshot or a .gguf file; InputError otherwise
            local = hf_models.resolve_hf_model(path)
            identity = (cache_mod.gguf_identity(local) if hf_models.is_gguf(local)
                        else cache_mod.hf_model_identity(local))
            entries.append(ModelEntry(name, kind, path, identity=identity, local=local))
            continue
        (source,) = checkpoint_sources(path, iteration=args.iteration)
        iteration, it_dir, configs = source.iteration, source.path, source.format.configs
        seed = int(configs["training"].seed)
        entries.append(ModelEntry(name, kind, path, iteration, seed, cache_mod.checkpoint_identity(
            it_dir, path, iteration, configs["data"], tokenizer_model=args.tokenizer_model)))
    return entries


def _export_child(root: str, iteration: int, out: str, queue,
                  tokenizer_model: Optional[str] = None) -> None:
    try:
        queue.put(("ok", convert(root, out, iteration=iteration,
                                 tokenizer_model=tokenizer_model)))
    except UserError as err:  # a bad input, a damaged or refused checkpoint: one line
        queue.put(("input", phrase(err, TOOLS)))
    except BaseException as err:  # noqa: BLE001 - reported by the parent
        queue.put(("error", f"{type(err).__name__}: {err}"))


def export_checkpoint(root: str, iteration: int, out: str,
                      tokenizer_model: Optional[str] = None) -> List[str]:
    """``to_hf.convert`` in a spawned process (megatron's process group and its CPU
    redirections stay out of the evaluating process); returns its warnings. An interrupt (Ctrl-C,
    SIGTERM) ends the child before the caller removes the directory it writes in.
    ``tokenizer_model`` replaces the run's tokenizer file (``--tokenizer-model``)."""
    import queue as queue_mod

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_export_child, args=(root, iteration, out, queue, tokenizer_model))
    proc.start()
    status = value = None
    try:
        while status is None:
            try:
                status, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                if not proc.is_alive() and queue.empty():
                    status, value = "error", f"the export process died (exit code {proc.exitcode})"
    finally:
        if status is None:  # interrupted: the child writes in the caller's temporary directory
            proc.terminate()
        proc.join()
    if status == "input":
        raise InputError(value)
    if status != "ok":
        raise RuntimeError(f"exporting {root} iteration {iteration} failed: {value}")
    return value


def _limit(value: Optional[float]):
    if value is None:
        return None
    if not value > 0:
        raise InputError(f"--limit {value:g}: must be > 0 (N examples, or a fraction below 1)")
    return int(value) if value >= 1 and value == int(value) else value


_AUTO_BATCH = re.compile(r"auto(:(?P<times>\d+))?")


def _batch_size(value: str):
    """lm-eval's batch size: an int >= 1, "auto" or "auto:N" (the largest batch that fits is
    searched for N times over the run; N >= 1). lm-eval takes 0 or a negative size without a
    word and scores nothing, or fails deep in a batch loop."""
    text = value.strip().lower()
    auto = _AUTO_BATCH.fullmatch(text)
    if auto and (auto.group("times") is None or int(auto.group("times")) >= 1):
        return text
    try:
        size = int(text)
    except ValueError:
        size = None
    if size is None or size < 1:
        raise InputError(f"--batch-size {value}: expected an integer >= 1, auto or auto:N "
                         "(N >= 1)")
    return size


def evaluate_model(entry: ModelEntry, names, digests, manager, cache, args, limit) -> dict:
    """{task: lm-eval result} for one model, from the cache where it can."""
    settings = dict(limit=limit, num_fewshot=args.num_fewshot, dtype=args.dtype,
                    lm_eval=harness.lm_eval_version(),
                    transformers=harness.package_version("transformers"))
    keys = {t: cache.key(entry.identity, task=t, task_config=digests[t], **settings)
            for t in names}
    results = {t: cache.get(keys[t]) for t in names}
    missing = [t for t in names if results[t] is None]
    if not missing:
        return results
    # one writer per cache entry: held while the missing tasks are evaluated and put
    with cache.writing({f"{entry.label}/{t}": keys[t] for t in missing}):
        for t in missing:  # a run that held the locks just before may have put them
            results[t] = cache.get(keys[t])
        missing = [t for t in missing if results[t] is None]
        if missing:
            fresh = _evaluate(entry, missing, manager, args, limit)
            for t in missing:
                cache.put(keys[t], fresh[t])
                results[t] = fresh[t]
    return results


def _evaluate(entry: ModelEntry, missing, manager, args, limit) -> dict:
    run = dict(dtype=args.dtype, device=args.device, batch_size=_batch_size(args.batch_size),
               limit=limit,
               num_fewshot=args.num_fewshot, device_map=args.device_map)
    print(f"{PROG}: {entry.label}: evaluating {', '.join(missing)}", file=sys.stderr)
    if entry.kind == "hf_model" and not hf_models.is_gguf(entry.local) and not args.device_map:
        fresh = harness.evaluate_hf(entry.local, missing, manager, **run)
    else:
        # a checkpoint's export, a GGUF file's dense weights and accelerate's offload folder
        # live here, and go with it (also on an error or Ctrl-C)
        with tempfile.TemporaryDirectory(prefix="eval_downstream.") as tmp:
            if entry.kind == "load":
                model_dir = os.path.join(tmp, "hf")
                for warning in export_checkpoint(entry.path, entry.iteration, model_dir,
                                                 args.tokenizer_model):
                    print(f"{PROG}: warning: {entry.label}: {warning}", file=sys.stderr)
            elif hf_models.is_gguf(entry.local):
                print(f"{PROG}: {entry.label}: dequantizing {entry.local} into {tmp}",
                      file=sys.stderr)
                # in the dtype the model runs in: half the disk of fp32 for bf16
                model_dir = hf_models.dequantize_gguf(entry.local, os.path.join(tmp, "hf"),
                                                      dtype=hf_models.torch_dtype(args.dtype))
            else:
                model_dir = entry.local
            if args.device_map:
                run["offload_folder"] = os.path.join(tmp, "offload")
            fresh = harness.evaluate_hf(model_dir, missing, manager, **run)
    return fresh


def run(args: DownstreamConfig) -> List[DownstreamReport]:
    for flag, path in (("--json", args.json), ("--csv", args.csv)):
        if path:
            check_output_path(path, flag)
    if not args.no_cache:
        check_output_dir(os.path.expanduser(args.cache_dir), "--cache-dir", args.cache_dir)
    if args.num_fewshot < 0:
        raise InputError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    limit = _limit(args.limit)
    _batch_size(args.batch_size)  # before any model is loaded
    hf_models.check_device_map(args.device_map, args.device)
    if args.device_map is None:  # a GPU that is not here: refused, not lm-eval's traceback
        resolve_device(args.device)
    names = resolve_tasks(args.tasks)
    entries = _entries(args)
    manager, digests = harness.load_tasks(args.include_path, names)
    cache = cache_mod.ResultCache(None if args.no_cache else args.cache_dir)
    reports = []
    for entry in entries:
        results = evaluate_model(entry, names, digests, manager, cache, args, limit)
        report = DownstreamReport(entry.label, entry.path, entry.iteration, entry.seed,
                                  harness.lm_eval_version(), limit, args.num_fewshot, args.dtype)
        for t in names:
            metric, value, stderr = pick_metric(t, results[t]["metrics"], args.metric)
            report.tasks[t] = TaskScore(metric, value, stderr, results[t].get("samples"),
                                       results[t]["metrics"])
        reports.append(report)
    return reports


_DEFAULT_IN_CHILD: set = set()  # signals a forked child takes with their default action


def _reset_in_child():
    for signum in _DEFAULT_IN_CHILD:
        try:
            signal.signal(signum, signal.SIG_DFL)
        except (ValueError, OSError):  # not the main thread of the child: left as it is
            pass


os.register_at_fork(after_in_child=_reset_in_child)


@contextlib.contextmanager
def _signals_as_interrupt_here(signums=(signal.SIGTERM, signal.SIGHUP)):
    """``signals_as_interrupt`` for this process only. lm-eval forks a ``multiprocessing``
    pool to bootstrap its stderrs and ends it with ``terminate()`` (SIGTERM). A forked child
    takes these signals' default action from the moment it exists: with the handler
    inherited, a worker died with a ``KeyboardInterrupt: SIGTERM`` traceback, and a worker
    blocked in C (on a lock held at the fork by another thread of this process) never ran
    the Python handler at all, so ``terminate()`` waited for it forever."""
    with signals_as_interrupt(signums):
        if threading.current_thread() is not threading.main_thread():  # none was set
            yield
            return
        _DEFAULT_IN_CHILD.update(signums)
        try:
            yield
        finally:
            _DEFAULT_IN_CHILD.difference_update(signums)
