"""Small stand-ins for the hub datasets of the paper's lm-eval tasks, in the offline cache.

``populate_paper_datasets(hf_home)`` writes, for each of the nine tasks of ``--tasks
paper``, a few generated rows per split into the ``datasets`` cache under
``hf_home/datasets``, in the layout that ``load_dataset(path, name)`` reads back with
``HF_DATASETS_OFFLINE=1`` (``CachedDatasetModuleFactory`` and the ``cache`` packaged
module): ``<namespace>___<name>/<config>/<version>/<hash>/`` with ``dataset_info.json``
and one ``<name>-<split>.arrow`` per split. The files are written by a ``datasets``
builder whose ``repo_id``, config and hash put them exactly there, so the layout is the
library's own. This is what the docs tell air-gapped users: pre-populate the cache.

Paths, configs and splits are those of lm-eval 0.4.13's task YAMLs; the columns and types
are the hub datasets' own (the ones the prompts use, plus the other real columns). The
rows are generated text of short ASCII words (the tiny byte-level models score them), not
copies of real data.
"""

import hashlib
import json
import os
import random

import datasets
from datasets import ClassLabel, Features, List, Value
from datasets.builder import Key

S = Value("string")
WORDS = ("the a of and to in is it was on at for with as by from this that he she they we "
         "jump layer norm token state model cat dog sun rain tree road water light stone "
         "river bird house book door hand").split()
LETTERS = "ABCDE"

# task -> (dataset_path, dataset_name, splits), as in lm-eval's task configs
TASKS = {
    "lambada_openai": ("EleutherAI/lambada_openai", "default", ("test",)),
    "boolq": ("aps/super_glue", "boolq", ("train", "validation")),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", ("train", "validation", "test")),
    "hellaswag": ("Rowan/hellaswag", None, ("train", "validation")),
    "piqa": ("baber/piqa", None, ("train", "validation")),
    "race": ("EleutherAI/race", "high", ("test",)),
    "social_iqa": ("lighteval/siqa", None, ("train", "validation")),
    "sciq": ("allenai/sciq", None, ("train", "validation", "test")),
    "swag": ("allenai/swag", "regular", ("train", "validation")),
}

FEATURES = {
    "lambada_openai": Features({"text": S}),
    "boolq": Features({"question": S, "passage": S, "idx": Value("int32"),
                       "label": ClassLabel(names=["False", "True"])}),
    "arc_easy": Features({"id": S, "question": S,
                          "choices": {"text": List(S), "label": List(S)}, "answerKey": S}),
    "hellaswag": Features({"ind": Value("int32"), "activity_label": S, "ctx_a": S, "ctx_b": S,
                           "ctx": S, "endings": List(S), "source_id": S, "split": S,
                           "split_type": S, "label": S}),
    "piqa": Features({"goal": S, "sol1": S, "sol2": S, "label": ClassLabel(names=["0", "1"])}),
    "race": Features({"article": S, "problems": S}),
    "social_iqa": Features({"context": S, "question": S, "answerA": S, "answerB": S,
                            "answerC": S, "label": S}),
    "sciq": Features({"question": S, "distractor3": S, "distractor1": S, "distractor2": S,
                      "correct_answer": S, "support": S}),
    "swag": Features({"video-id": S, "fold-ind": S, "startphrase": S, "sent1": S, "sent2": S,
                      "gold-source": S, "ending0": S, "ending1": S, "ending2": S, "ending3": S,
                      "label": ClassLabel(names=["0", "1", "2", "3"])}),
}


def _words(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _row(task, rng, split, i):
    """One generated row of ``task`` with the hub dataset's columns."""
    w = lambda lo=1, hi=3: _words(rng, lo, hi)  # noqa: E731
    if task == "lambada_openai":
        return {"text": w(4, 7)}  # the prompt is all but the last word
    if task == "boolq":
        return {"question": w(2, 3), "passage": w(3, 5), "idx": i, "label": rng.randrange(2)}
    if task == "arc_easy":
        n = rng.choice((3, 4, 4, 5))  # ARC has 3 to 5 choices
        return {"id": f"tiny_{split}_{i}", "question": w(3, 6),
                "choices": {"text": [w() for _ in range(n)], "label": list(LETTERS[:n])},
                "answerKey": LETTERS[rng.randrange(n)]}
    if task == "hellaswag":
        ctx_a, ctx_b = w(3, 5), w(1, 3)
        return {"ind": i, "activity_label": rng.choice(WORDS).capitalize(), "ctx_a": ctx_a,
                "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}", "endings": [w() for _ in range(4)],
                "source_id": f"tiny~{split}_{i}",
                "split": "val" if split == "validation" else split,  # the hub's names
                "split_type": "indomain", "label": str(rng.randrange(4))}
    if task == "piqa":
        return {"goal": w(3, 6), "sol1": w(), "sol2": w(), "label": rng.randrange(2)}
    if task == "race":
        # a Python literal (lm-eval parses it with ast.literal_eval); the first problem is a
        # cloze ("  _  ."), answered in the prompt, the last one is scored
        problems = [{"answer": rng.choice("ABCD"), "options": [w(1, 1) for _ in range(4)],
                     "question": w(1, 2) + "  _  ."},
                    {"answer": rng.choice("ABCD"), "options": [w(1, 2) for _ in range(4)],
                     "question": w(1, 3) + "?"}]
        return {"article": w(2, 3), "problems": repr(problems)}
    if task == "social_iqa":
        return {"context": w(2, 4), "question": w(2, 3) + "?", "answerA": w(), "answerB": w(),
                "answerC": w(), "label": str(rng.randint(1, 3))}
    if task == "sciq":
        return {"question": w(2, 4) + "?", "distractor3": w(1, 2), "distractor1": w(1, 2),
                "distractor2": w(1, 2), "correct_answer": w(1, 2),
                "support": "" if i == 0 else " " + w(2, 4)}  # real rows may lack support
    if task == "swag":
        sent1, sent2 = w(3, 5), w(1, 2)
        row = {"video-id": f"tiny_{split}_{i}", "fold-ind": str(i),
               "startphrase": f"{sent1} {sent2}", "sent1": sent1, "sent2": sent2,
               "gold-source": "gold", "label": rng.randrange(4)}
        row.update({f"ending{k}": w() for k in range(4)})
        return row
    raise KeyError(task)


class _Rows(datasets.GeneratorBasedBuilder):
    """Writes given rows as the splits of one dataset config."""

    def __init__(self, *, rows, features, **kwargs):
        self._rows, self._features = rows, features
        super().__init__(**kwargs)

    def _info(self):
        return datasets.DatasetInfo(features=self._features)

    def _split_generators(self, dl_manager):
        return [datasets.SplitGenerator(name=split, gen_kwargs={"rows": rows})
                for split, rows in self._rows.items()]

    def _generate_examples(self, rows):
        for i, row in enumerate(rows):
            yield Key(0, i), row


def populate_paper_datasets(hf_home: str, docs_per_split: int = 4) -> dict:
    """Write the nine tasks' datasets into ``hf_home/datasets``; {task: docs evaluated}."""
    cache_dir = os.path.join(hf_home, "datasets")
    counts = {}
    for seed, (task, (path, name, splits)) in enumerate(TASKS.items()):
        rng = random.Random(seed)
        rows = {s: [_row(task, rng, s, i) for i in range(docs_per_split)] for s in splits}
        digest = hashlib.sha1(json.dumps([path, name, rows], sort_keys=True).encode()).hexdigest()
        builder = _Rows(rows=rows, features=FEATURES[task], cache_dir=cache_dir,
                        dataset_name=path.split("/")[-1], repo_id=path,
                        config_name=name or "default", hash=digest)
        builder.download_and_prepare()
        counts[task] = docs_per_split  # every split has the same number of rows
    return counts
