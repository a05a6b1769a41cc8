"""The flags of ``eval_downstream`` as a typed settings object (``DownstreamConfig``), the
one thing its command line and :mod:`megatron_jreg.downstream.evaluate` share. Light to
import, so ``--help`` and a bad flag answer before any model code loads."""

from __future__ import annotations

import dataclasses
import os
from typing import List, Optional

from megatron_jreg import hf_models
from megatron_jreg.config.schema import setting
from megatron_jreg.downstream.tasks import METRICS

PROG = "eval_downstream"
DEFAULT_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                             "megatron_jreg", "eval_downstream")


@dataclasses.dataclass(kw_only=True)
class DownstreamConfig:
    """The flags of ``eval_downstream``: what :func:`run` evaluates and writes."""

    load: Optional[List[str]] = setting(metavar="CKPT", exclusive="model", group="models",
                                      help="--save directories of training runs (any TP/PP)")
    hf_model: Optional[List[str]] = setting(
        metavar="MODEL", exclusive="model", group="models",
        help="Hugging Face causal LMs: directories written by save_pretrained, hub ids already "
        "in the local Hugging Face cache (read offline, never downloaded), or .gguf files "
        "(dequantized into a temporary directory, removed afterwards)")
    iteration: Optional[int] = setting(metavar="N", group="models", default_help="the latest",
                                     help="the iteration of each --load run")
    tokenizer_model: Optional[str] = setting(
        metavar="PATH", group="models",
        help="the tokenizer of the --load runs, if its file moved since training (a "
        "GPT2BPETokenizer run: the directory holding vocab.json and merges.txt); another "
        "tokenizer is used as asked, with one warning")
    label: Optional[List[str]] = setting(action="append", metavar="NAME", group="models",
                                       help="a model's name in the outputs; once per model")
    tasks: str = setting("paper", group="tasks", help="'paper' (lambada_openai, boolq, arc_easy, "
                       "hellaswag, piqa, race, social_iqa, sciq, swag) or a comma list of "
                       "lm-eval task names")
    include_path: Optional[List[str]] = setting(action="append", metavar="DIR", group="tasks",
                                              help="a folder of local task YAMLs (repeatable)")
    metric: str = setting("acc", choices=list(METRICS), group="tasks",
                        help="acc_norm: taken where a task reports it, acc elsewhere")
    limit: Optional[float] = setting(group="tasks", metavar="N",
                                   help="the first N examples per task (a value below 1: that "
                                   "fraction)")
    num_fewshot: int = setting(0, group="tasks", help="few-shot examples per prompt")
    batch_size: str = setting("8", group="how to run the model",
                            help="lm-eval's batch size: an integer >= 1, auto, or auto:N "
                            "(the largest batch is searched for N times)")
    device: str = setting("cpu", group="how to run the model", help="torch device, e.g. cuda:0")
    dtype: str = setting("float32", choices=["float32", "bfloat16", "float16"],
                       group="how to run the model", help="dtype the model runs in")
    device_map: Optional[str] = setting(
        choices=list(hf_models.DEVICE_MAPS), group="how to run the model",
        help="for a model larger than one GPU: accelerate spreads its layers over the visible "
        "GPUs (auto: evenly, then the CPU when they are full; lm-eval's parallelize=True); "
        "without a GPU all of it runs on the CPU. Replaces --device. Needs accelerate.")
    json: Optional[str] = setting(metavar="OUT.json", group="outputs",
                                help="write one object per model (a list when there are several)")
    csv: Optional[str] = setting(metavar="OUT.csv", group="outputs",
                               help="write model,source,iteration,task,metric,value,stderr rows")
    cache_dir: str = setting(DEFAULT_CACHE, group="outputs",
                           help="results per (model, task, limit) are kept here")
    no_cache: bool = setting(False, group="outputs", help="neither read nor write the cache")
