"""--split without a validation part, and --data-cache-path, in real runs."""

import json
import os

from trainer_runs import base_args, train


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_split_without_validation_warns_and_validates_nothing(demo_data, tmp_path):
    runs = {}
    for split in ("100,0,0", "90,10,0"):
        metrics = tmp_path / f"{split.replace(',', '_')}.jsonl"
        proc = train(base_args(demo_data, train_iters=4, eval_interval=2, eval_iters=1,
                               split=split, metrics_file=metrics))
        runs[split] = (proc.stdout + proc.stderr, _rows(metrics))
    log, rows = runs["100,0,0"]
    assert log.count("warning: the --split gives no validation data; validation is off") == 1
    assert not any("validation_lm_loss" in r for r in rows)
    assert [r["iteration"] for r in rows if "lm_loss" in r] == [1, 2, 3, 4]  # training ran
    # the same run with a validation part: validated at 2 and 4 (and no warning)
    log, rows = runs["90,10,0"]
    assert "gives no validation data" not in log
    assert [r["iteration"] for r in rows if "validation_lm_loss" in r] == [2, 4]


def test_data_cache_path_holds_the_index_cache(demo_data, tmp_path):
    """The dataset index files go under --data-cache-path (not beside the data), and a second
    run reads them back: the same batches, nothing rebuilt."""
    cache = tmp_path / "cache"
    data_dir = os.path.dirname(demo_data)
    before = set(os.listdir(data_dir))
    metrics = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for m in metrics:
        train(base_args(demo_data, train_iters=2, data_cache_path=cache, metrics_file=m))
        if m == metrics[0]:
            built = {p: os.path.getmtime(os.path.join(r, p)) for r, _, files in os.walk(cache)
                     for p in files}
    assert any(name.endswith(".npy") for name in built), built
    assert set(os.listdir(data_dir)) == before  # nothing written beside the data
    again = {p: os.path.getmtime(os.path.join(r, p)) for r, _, files in os.walk(cache)
             for p in files}
    assert again == built  # read back, not rebuilt
    first, second = (_rows(m) for m in metrics)
    assert [r["lm_loss"] for r in first] == [r["lm_loss"] for r in second]
