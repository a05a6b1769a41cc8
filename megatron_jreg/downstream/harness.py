"""lm-evaluation-harness, called through its Python API on a Hugging Face directory.

The tasks are loaded once before any model (a checkpoint's export included), so an unknown
task name or a dataset that is neither cached nor reachable fails first, with one line
saying how to fix it. The model is lm-eval's ``hf`` backend (``simple_evaluate(model="hf",
model_args={"pretrained": DIR, "dtype": ...})``), so the numbers are lm-eval's own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Dict, List, Optional

from megatron_jreg.downstream.cache import file_key
from megatron_jreg.downstream.task_checks import check_duplicates, check_targets, skipped_yaml
from megatron_jreg.downstream.tasks import task_metrics
from megatron_jreg.errors import InputError, missing_extra
from megatron_jreg.platform.device import device_type

OFFLINE_HINT = (
    "pre-populate the datasets cache on a machine with network access (HF_HOME=DIR "
    "python tools/eval_downstream.py ... once, or datasets.load_dataset), copy DIR here and "
    "run with HF_HOME=DIR HF_DATASETS_OFFLINE=1; or give a local task YAML with --include-path"
)


def package_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed: the import that needs it says so
        return "unknown"


def lm_eval_version() -> str:
    return package_version("lm_eval")


def _import_lm_eval():
    try:
        import lm_eval  # noqa: F401
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise missing_extra("lm_eval", "eval", "tools/eval_downstream.py") from None
    for name in ("lm-eval", "lm_eval"):  # its INFO lines per request are noise here
        logging.getLogger(name).setLevel(logging.WARNING)
    return TaskManager


def _check_folders(include_path: Optional[List[str]]) -> None:
    for path in include_path or []:
        if not os.path.isdir(path):
            raise InputError(f"--include-path {path}: no such directory; give the folder of "
                             "the task YAML files")


def task_manager(include_path: Optional[List[str]] = None):
    """lm-eval's TaskManager with the local task YAMLs of ``include_path``."""
    _check_folders(include_path)
    TaskManager = _import_lm_eval()
    return TaskManager(include_path=list(include_path) if include_path else None)


def load_tasks(include_path: Optional[List[str]], names: List[str]):
    """(TaskManager, {name: config digest}) for ``names`` (see :func:`check_tasks`).

    When every task is one of ``include_path``'s, they are loaded by a manager that indexes
    only those folders: indexing lm-eval's own thousands of task YAMLs takes seconds on
    every run. A local task that needs one of lm-eval's (a group of its tasks, a YAML it
    includes) is loaded again with lm-eval's tasks indexed too."""
    if include_path:
        _check_folders(include_path)
        check_duplicates(include_path, names)  # lm-eval would take one with a warning
        TaskManager = _import_lm_eval()
        local = TaskManager(include_path=list(include_path), include_defaults=False)
        if set(names) <= set(local.all_tasks):
            try:
                return local, check_tasks(local, names)
            except InputError:
                pass
    manager = task_manager(include_path)
    return manager, check_tasks(manager, names, include_path)


def check_tasks(manager, names: List[str],
                include_path: Optional[List[str]] = None) -> Dict[str, str]:
    """Load each task (its dataset included) before any model; {name: config digest}.
    An unknown task names the YAML of ``include_path`` lm-eval skipped, if one was; a
    multiple-choice task's targets must index its choices (``task_checks``).

    The digest (of the task's resolved config: dataset, prompts, metrics, and the content
    of every local file the config names, e.g. its ``data_files``) keys the cache, so an
    edited local task or data file is evaluated again.
    """
    known = set(manager.all_tasks)
    unknown = [n for n in names if n not in known]
    if unknown:
        skipped = skipped_yaml(include_path, unknown)
        if skipped:
            raise InputError(f"--tasks: unknown task {', '.join(unknown)}; {skipped}")
        raise InputError(
            f"--tasks: unknown task {', '.join(unknown)}; lm-eval's names are listed by "
            "`lm_eval ls tasks`; a local task needs its YAML folder in --include-path")
    digests: Dict[str, str] = {}
    for name in names:
        try:
            with contextlib.redirect_stdout(sys.stderr):
                loaded = manager.load([name])
        except (ConnectionError, OSError) as err:
            raise InputError(
                f"task {name}: its dataset is not in the local cache and the hub cannot be "
                f"reached ({str(err).splitlines()[0][:160]}); {OFFLINE_HINT}") from None
        except Exception as err:  # noqa: BLE001 - datasets' own errors (DatasetNotFoundError ...)
            text = str(err).splitlines()[0][:160] if str(err) else ""
            if "offline" in text.lower() or "hub" in text.lower() or "connect" in text.lower():
                raise InputError(
                    f"task {name}: dataset unavailable ({text}); {OFFLINE_HINT}") from None
            raise InputError(f"task {name}: lm-eval cannot load it ({type(err).__name__}: "
                             f"{text}); check the task's YAML") from None
        tasks = loaded["tasks"] if isinstance(loaded, dict) and "tasks" in loaded else loaded
        for task_name, task in dict(tasks).items():
            check_targets(str(task_name), task)
        digests[name] = _digest(tasks)
    return digests


def _digest(tasks) -> str:
    import hashlib

    def config(task):
        dump = getattr(task, "dump_config", None)
        return dump() if dump else repr(task)

    items = sorted((str(k), config(v)) for k, v in dict(tasks).items())
    text = json.dumps(items, sort_keys=True, default=_stable)
    files = {path: file_key(path) for path in sorted(_local_files(items))}
    return hashlib.sha256((text + json.dumps(files, sort_keys=True)).encode()).hexdigest()


def _local_files(value) -> set:
    """The existing local files a task config names (its data files, a local dataset path)."""
    if isinstance(value, str):
        if os.path.isabs(value) and os.path.isfile(value):
            return {os.path.realpath(value)}
        return set()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return set().union(*(_local_files(v) for v in value)) if value else set()
    return set()


def _stable(value) -> str:
    """A value json cannot write, as text that is the same in every process: a function
    (lm-eval leaves those of ``fewshot_config`` as objects) by its source, never by the
    ``<function f at 0x...>`` address that ``str`` gives."""
    import inspect

    if callable(value):
        try:
            return inspect.getsource(value)
        except (OSError, TypeError):
            return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', value)}"
    return str(value)


def model_args(model_dir: str, dtype: str, device_map: Optional[str] = None,
               offload_folder: Optional[str] = None) -> dict:
    """lm-eval's ``hf`` model arguments. With ``device_map`` it is lm-eval's
    ``parallelize=True``, which gives accelerate only the GPUs' memory: the CPU's is added
    (as ``from_pretrained(device_map="auto")`` does), so that a model larger than the GPUs
    is kept in CPU memory and, without a GPU, runs on the CPU instead of going to disk."""
    args = {"pretrained": model_dir, "dtype": dtype}
    if device_map is not None:
        from accelerate.utils import get_max_memory

        args.update(parallelize=True, device_map=device_map,
                    max_cpu_memory=int(get_max_memory()["cpu"]))
        if offload_folder is not None:
            args["offload_folder"] = offload_folder
    return args


def evaluate_hf(model_dir: str, names: List[str], manager, *, dtype: str, device: str,
                batch_size: str, limit: Optional[float], num_fewshot: int,
                device_map: Optional[str] = None,
                offload_folder: Optional[str] = None) -> Dict[str, dict]:
    """lm-eval's results for ``names`` on the HF directory: {task: {"metrics": {..},
    "samples": n}}, from one ``simple_evaluate`` call (one model load). ``device_map``
    spreads the model over the visible GPUs (the CPU without one); lm-eval's inputs then
    start on the first GPU."""
    from lm_eval import simple_evaluate

    if device_map is not None:  # lm-eval's inputs go where the first layers went
        device = device_type()
    # lm-eval prints progress lines ("bootstrapping for stddev") to stdout: the table owns it
    with contextlib.redirect_stdout(sys.stderr):
        out = simple_evaluate(
            model="hf", model_args=model_args(model_dir, dtype, device_map, offload_folder),
            tasks=list(names), task_manager=manager, device=device, batch_size=batch_size,
            limit=limit, num_fewshot=num_fewshot, log_samples=False)
    samples = out.get("n-samples", {})
    results = {}
    for name in names:
        if name not in out["results"]:
            raise InputError(f"task {name}: lm-eval returned no result for it (a group? give "
                             "its member tasks)")
        count = samples.get(name, {})
        results[name] = {"metrics": task_metrics(out["results"][name]),
                         "samples": count.get("effective", count.get("original"))}
    return results
