"""eval_downstream's result cache evaluates again when an input it keys changes, and the
flags --device, --dtype, --limit, --metric and --num-fewshot do what they say.

One module fixture runs the tool in process (``main``) on a copy of the tiny HF Llama and
one local four-way multiple-choice task, with one cache directory, in this order: the
defaults (all eight documents); the same with ``--metric acc_norm`` (a cache hit);
``--limit 3``; then, each on the first three documents and each differing from the
``--limit 3`` run (or from the one before it) in one input only: ``--num-fewshot 2``,
``--dtype bfloat16``, new weights in the model directory, an edited task YAML. A spy on
lm-eval's ``HFLM.loglikelihood`` records what the harness was asked (the prompts) and how
the model ran (dtype, device); the tool's stderr says which task it evaluated.

Every reported number is checked against a direct scoring written here: the model's
log-likelihood of each choice after ``<s>`` and the prompt's words (the tokenizer maps
``w<i>`` to id 4 + i), then acc (argmax), acc_norm (argmax of the log-likelihood per
character of the choice) and the Brier score of the softmax over the choices.
"""

import contextlib
import io
import json
import os
import random
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

TASK = "wchoice"
N_DOCS, N_SHOTS, LIMIT = 8, 2, 3
ORDER = ["base", "metric", "limit", "fewshot", "dtype", "weights", "yaml", "data"]
YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    train: {root}/train.jsonl
    test: {root}/test.jsonl
  cache_dir: {root}/datasets
training_split: train
test_split: test
fewshot_split: train
fewshot_config:
  sampler: first_n
output_type: multiple_choice
doc_to_text: "{prompt}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
  - metric: brier_score
"""
PROMPT, EDITED_PROMPT = "{{question}}", "w0 {{question}}"  # the edit: w0 before each question


def write_task(root, seed=0):
    """The task's YAML and its train (few-shot) and test splits; returns (train, test)."""
    rng = random.Random(seed)

    def words(k):
        return " ".join(f"w{rng.randrange(90)}" for _ in range(k))

    splits = {}
    for split, n in (("train", N_SHOTS), ("test", N_DOCS)):
        splits[split] = [{"question": words(3), "label": rng.randrange(4),
                          "choices": [words(rng.randint(1, 3)) for _ in range(4)]}
                         for _ in range(n)]
        with open(os.path.join(root, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in splits[split])
    with open(os.path.join(root, f"{TASK}.yaml"), "w") as f:
        f.write(YAML.format(task=TASK, root=root, prompt=PROMPT))
    return splits["train"], splits["test"]


def edit_prompt(yaml_path):
    """The task's YAML with EDITED_PROMPT for doc_to_text; its data files are left as they are."""
    with open(yaml_path) as f:
        text = f.read()
    old = f'doc_to_text: "{PROMPT}"\n'
    assert text.count(old) == 1
    with open(yaml_path, "w") as f:
        f.write(text.replace(old, f'doc_to_text: "{EDITED_PROMPT}"\n'))


def edit_data(root):
    """The test split's file edited in place (each document's gold label moved by one); the
    YAML is left as it is. Returns the new test documents."""
    path = os.path.join(root, "test.jsonl")
    docs = [json.loads(line) for line in open(path)]
    for doc in docs:
        doc["label"] = (doc["label"] + 1) % 4
    with open(path, "w") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in docs)
    return docs


# ---- the direct scoring ------------------------------------------------------------------


def _ids(text):
    return [4 + int(word[1:]) for word in text.split()]


def load_model(model_dir, dtype=torch.float32):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def loglikelihood(model, prompt, choice):
    """log p(choice | <s> prompt), summed over the choice's tokens in the model's dtype."""
    seq = [2] + _ids(prompt) + _ids(choice)
    n = len(_ids(choice))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq[:-1]])).logits[0], dim=-1)
    return float(logp[-n:].gather(1, torch.tensor(seq[-n:])[:, None]).sum())


def score(model, docs, prefix=""):
    """{"acc", "acc_norm", "brier_score"} over ``docs``, each prompt ``prefix`` + question."""
    acc = norm = brier = 0.0
    for doc in docs:
        lls = [loglikelihood(model, prefix + doc["question"], c) for c in doc["choices"]]
        per_char = [ll / len(c) for ll, c in zip(lls, doc["choices"])]
        acc += lls.index(max(lls)) == doc["label"]
        norm += per_char.index(max(per_char)) == doc["label"]
        probs = torch.softmax(torch.tensor(lls, dtype=torch.float64), 0)
        gold = torch.eye(len(lls), dtype=torch.float64)[doc["label"]]
        brier += float(((probs - gold) ** 2).sum())
    return {"acc": acc / len(docs), "acc_norm": norm / len(docs), "brier_score": brier / len(docs)}


def few_shot_prefix(train):
    return " ".join(f"{d['question']} {d['choices'][d['label']]}" for d in train[:N_SHOTS]) + " "


# ---- the runs ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tiny_hf_model, tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    from megatron_jreg.commands.eval_downstream import main

    root = tmp_path_factory.mktemp("cache_misses")
    model_dir = str(root / "model")
    shutil.copytree(tiny_hf_model, model_dir)
    tasks = str(root / "tasks")
    os.makedirs(tasks)
    train, test = write_task(tasks)
    cache = root / "cache"
    calls = []
    original = HFLM.loglikelihood

    def spy(self, requests, *args, **kwargs):
        out = original(self, requests, *args, **kwargs)
        calls.append({"dtype": self.model.dtype, "device": str(self.device),
                      "params": {str(p.device) for p in self.model.parameters()},
                      "prompts": [r.args for r in requests]})
        return out

    out = {"model": model_dir, "original": tiny_hf_model, "tasks": tasks, "train": train,
           "test": test, "cache": cache}

    def run(name, *extra, check=True):
        """One call of the tool; {"rc", "stdout", "stderr", "calls", "entries", "report"}."""
        before = len(calls)
        stdout, stderr = io.StringIO(), io.StringIO()
        report = root / f"{name}.json"
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(["--hf-model", model_dir, "--tasks", TASK, "--include-path", tasks,
                       "--batch-size", "1", "--cache-dir", str(cache), "--json", str(report),
                       *extra])
        assert rc == 0 or not check, stderr.getvalue()[-3000:]
        out[name] = {"rc": rc, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                     "calls": calls[before:], "entries": len(list(cache.glob("*.json"))),
                     "report": json.loads(report.read_text()) if report.exists() else None}
        return out[name]

    with pytest.MonkeyPatch.context() as mp:
        for key, value in (("HF_DATASETS_OFFLINE", "1"), ("HF_HUB_OFFLINE", "1"),
                           ("TOKENIZERS_PARALLELISM", "false")):
            mp.setenv(key, value)
        mp.setattr(HFLM, "loglikelihood", spy)
        limit = ("--limit", str(LIMIT))
        run("base", "--device", "cpu")
        run("metric", "--metric", "acc_norm")
        run("limit", *limit)
        run("fewshot", *limit, "--num-fewshot", str(N_SHOTS))
        run("dtype", *limit, "--dtype", "bfloat16")
        out["weights_stat"] = new_weights(model_dir)
        run("weights", *limit)
        edit_prompt(os.path.join(tasks, f"{TASK}.yaml"))
        run("yaml", *limit)
        out["edited_test"] = edit_data(tasks)
        run("data", *limit)
        out["run"] = run
        yield out


def new_weights(model_dir):
    """The output layer's weights negated, in place: the file keeps its size, only its
    content and mtime change. Returns (size, mtime_ns) before and after."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(model_dir, "model.safetensors")
    before = os.stat(path)
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    state["lm_head.weight"] = -state["lm_head.weight"]
    save_file(state, path, metadata=metadata)
    after = os.stat(path)
    return (before.st_size, before.st_mtime_ns), (after.st_size, after.st_mtime_ns)


def added_entries(runs, name):
    """How many cache entries the run ``name`` wrote (the runs are made in ORDER)."""
    return runs[name]["entries"] - runs[ORDER[ORDER.index(name) - 1]]["entries"]


def evaluated(run):
    """The tool said it evaluated the task, and lm-eval's model was asked for log-likelihoods."""
    return f": evaluating {TASK}\n" in run["stderr"] and len(run["calls"]) == 1


def check_scores(run, want, samples=LIMIT, metric="acc"):
    task = run["report"]["tasks"][TASK]
    assert task["samples"] == samples
    assert task["lm_eval"]["acc"] == want["acc"] and task["lm_eval"]["acc_norm"] == want["acc_norm"]
    assert task["lm_eval"]["brier_score"] == pytest.approx(want["brier_score"], rel=1e-9)
    assert task["metric"] == metric and task["value"] == pytest.approx(100 * want[metric])
    assert run["report"]["average"] == pytest.approx(100 * want[metric])


@pytest.fixture(scope="module")
def fp32(runs):
    """The direct scores of the original weights in float32, zero-shot: all documents, and
    the first LIMIT under "limit"."""
    model = load_model(runs["original"])
    return dict(score(model, runs["test"]), limit=score(model, runs["test"][:LIMIT]))


def prompts(docs, prefix=""):
    """lm-eval's requests for ``docs``: (prompt, " " + choice) for each choice."""
    return [(prefix + d["question"], " " + c) for d in docs for c in d["choices"]]


# ---- the flags -----------------------------------------------------------------------------


def test_defaults_evaluate_on_the_cpu_in_float32(runs, fp32):
    base = runs["base"]
    assert evaluated(base), base["stderr"]
    (call,) = base["calls"]
    assert (call["dtype"], call["device"], call["params"]) == (torch.float32, "cpu", {"cpu"})
    assert call["prompts"] == prompts(runs["test"])
    check_scores(base, fp32, samples=N_DOCS)
    report = base["report"]
    assert (report["limit"], report["num_fewshot"], report["dtype"]) == (None, 0, "float32")
    assert base["entries"] == 1


def test_metric_selects_the_reported_value_and_reads_the_cache(runs, fp32):
    """--metric picks among the values lm-eval reported: not part of the cache key."""
    assert fp32["acc_norm"] != fp32["acc"]  # else the test could not tell them apart
    run = runs["metric"]
    assert "evaluating" not in run["stderr"] and run["calls"] == []
    assert added_entries(runs, "metric") == 0
    check_scores(run, fp32, samples=N_DOCS, metric="acc_norm")
    lm_eval = run["report"]["tasks"][TASK]["lm_eval"]
    assert lm_eval == runs["base"]["report"]["tasks"][TASK]["lm_eval"]
    assert run["stdout"].splitlines()[1].split() == ["acc_norm"]  # the table's metric row


# ---- a changed input is a cache miss, and its numbers are reported -------------------------


def test_limit_evaluates_the_first_n_documents(runs, fp32):
    run = runs["limit"]
    assert evaluated(run), run["stderr"]
    assert run["calls"][0]["prompts"] == prompts(runs["test"][:LIMIT])
    want = fp32["limit"]
    assert want["acc"] != fp32["acc"]  # the cached all-document value would be wrong
    check_scores(run, want)
    assert run["report"]["limit"] == LIMIT and added_entries(runs, "limit") == 1
    assert f"limit {LIMIT} per task" in run["stdout"]


def test_num_fewshot_puts_the_first_examples_before_each_question(runs, fp32):
    run = runs["fewshot"]
    assert evaluated(run), run["stderr"]
    shots = "".join(f"{d['question']} {d['choices'][d['label']]}\n\n"
                    for d in runs["train"][:N_SHOTS])
    assert run["calls"][0]["prompts"] == prompts(runs["test"][:LIMIT], shots)
    want = score(load_model(runs["original"]), runs["test"][:LIMIT],
                 few_shot_prefix(runs["train"]))
    assert want["brier_score"] != pytest.approx(fp32["limit"]["brier_score"], rel=1e-6)
    check_scores(run, want)
    assert run["report"]["num_fewshot"] == N_SHOTS and added_entries(runs, "fewshot") == 1
    assert f"{N_SHOTS}-shot" in run["stdout"]


def test_dtype_bfloat16_runs_the_model_in_bfloat16(runs, fp32):
    run = runs["dtype"]
    assert evaluated(run), run["stderr"]
    assert run["calls"][0]["dtype"] == torch.bfloat16
    want = score(load_model(runs["original"], torch.bfloat16), runs["test"][:LIMIT])
    assert want["brier_score"] != pytest.approx(fp32["limit"]["brier_score"], rel=1e-6)
    check_scores(run, want)
    assert run["report"]["dtype"] == "bfloat16" and added_entries(runs, "dtype") == 1


def test_new_weights_of_the_same_size_are_evaluated(runs, fp32):
    (size, mtime), (new_size, new_mtime) = runs["weights_stat"]
    assert size == new_size and mtime != new_mtime  # only the content and the mtime changed
    run = runs["weights"]
    assert evaluated(run), run["stderr"]
    want = score(load_model(runs["model"]), runs["test"][:LIMIT])
    assert want["brier_score"] != pytest.approx(fp32["limit"]["brier_score"], rel=1e-6)
    check_scores(run, want)
    assert added_entries(runs, "weights") == 1


def test_an_edited_task_yaml_is_evaluated(runs):
    run = runs["yaml"]
    assert evaluated(run), run["stderr"]
    assert run["calls"][0]["prompts"] == prompts(runs["test"][:LIMIT], "w0 ")
    want = score(load_model(runs["model"]), runs["test"][:LIMIT], "w0 ")
    before = runs["weights"]["report"]["tasks"][TASK]["lm_eval"]["brier_score"]
    assert want["brier_score"] != pytest.approx(before, rel=1e-6)
    check_scores(run, want)
    assert added_entries(runs, "yaml") == 1


def test_an_edited_data_file_is_evaluated(runs):
    """The YAML names its data files by path: their content is part of the key too."""
    run = runs["data"]
    assert evaluated(run), run["stderr"]
    want = score(load_model(runs["model"]), runs["edited_test"][:LIMIT], "w0 ")
    before = runs["yaml"]["report"]["tasks"][TASK]["lm_eval"]["brier_score"]
    assert want["brier_score"] != pytest.approx(before, rel=1e-6)
    check_scores(run, want)
    assert added_entries(runs, "data") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cuda_device_without_a_gpu_is_refused_before_any_work(runs, device):
    """Refused before the cache is read: the settings of the last run, whose result is cached."""
    run = runs["run"](f"no_{device}", "--device", device, "--limit", str(LIMIT), check=False)
    lines = run["stderr"].strip().splitlines()
    assert run["rc"] == 2, run["stderr"][-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"eval_downstream: error: --device {device}")
    assert "CUDA" in lines[0] and "cpu" in lines[0], lines[0]
    assert run["calls"] == [] and run["report"] is None
    assert run["entries"] == runs["data"]["entries"]
