"""Two local lm-eval tasks with their data as JSON files (no network): a LAMBADA-style
last-word log-likelihood task and a four-way multiple-choice task, in ASCII words the byte
tokenizer of the tiny checkpoints reads, short enough for their 64-token context."""

import json
import os
import random

WORDS = ["jump", "layer", "norm", "token", "state", "model", "the", "of", "a", "residual"]
LAMBADA, CHOICE = "tiny_lambada", "tiny_choice"

LAMBADA_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' ' + text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""

CHOICE_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(root, n=24, seed=3):
    """Write the two tasks' YAMLs and JSON-lines data under ``root``; returns root."""
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    lam = os.path.join(root, "lambada.jsonl")
    with open(lam, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(6))}) + "\n")
    mc = os.path.join(root, "choice.jsonl")
    with open(mc, "w") as f:
        for _ in range(n):
            question = " ".join(rng.choice(WORDS) for _ in range(4))
            choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
                       for _ in range(4)]
            f.write(json.dumps({"question": question, "choices": choices,
                                "label": rng.randrange(4)}) + "\n")
    for name, template, data in ((LAMBADA, LAMBADA_YAML, lam), (CHOICE, CHOICE_YAML, mc)):
        with open(os.path.join(root, name + ".yaml"), "w") as f:
            f.write(template.format(task=name, data=data))
    return root
