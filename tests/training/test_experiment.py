"""ExperimentConfig: the sections composed, their YAML round trip, and every cross-section
check in one method, before any work."""

import pytest
from trainer_runs import base_args

from megatron_jreg.commands.train import from_argv
from megatron_jreg.data.datasets.batches import data_prefixes
from megatron_jreg.training.experiment import ExperimentConfig


def experiment(data, **overrides):
    return from_argv(base_args(data, **overrides))


def test_yaml_round_trip(demo_data):
    exp = experiment(demo_data, jreg_lambda=0.5, split="98,2,0")
    again = ExperimentConfig.from_yaml(exp.to_yaml())
    assert again == exp
    assert list(exp.sections()) == ["model", "parallel", "jreg", "optim", "training", "data",
                                    "checkpoint", "logging", "megatron_lm"]


def test_valid_demo_run_passes(demo_data):
    experiment(demo_data).validate(world_size=1, tokenizer_vocab_size=256)


@pytest.mark.parametrize("overrides, world, message", [
    ({"split": "a,b"}, 1, "--split 'a,b' is not numbers"),
    ({"split": "1,2,3,4"}, 1, "--split '1,2,3,4' is invalid"),
    # megatron-core re-reads --split with a digits-and-dots pattern: nan trained as 1,1 and
    # exponents failed its assertions
    ({"split": "nan,1,1"}, 1, "--split 'nan,1,1' is not numbers"),
    ({"split": "1e400,1,1"}, 1, "--split '1e400,1,1' is not numbers"),
    # megatron-core's BlendedDataset asserts every weight > 0 (a traceback), nan slipped through
    ({"data_path": ["0", "DATA", "1", "DATA"]}, 1,
     "--data-path weight 0.0 of 'DATA': every weight"),
    ({"data_path": ["nan", "DATA"]}, 1, "--data-path weight nan of 'DATA': every weight"),
    ({"data_path": ["inf", "DATA", "1", "DATA"]}, 1, "--data-path weight inf of 'DATA'"),
    ({"global_batch_size": 8}, 4, "--micro-batch-size x data-parallel size = 16"),
    ({"tensor_model_parallel_size": 2}, 3, "3 processes cannot hold TP 2 x PP 1"),
    ({"vocab_size": 100}, 1, "--vocab-size 100 is smaller than the tokenizer's 256"),
])
def test_cross_section_errors(demo_data, overrides, world, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("+", r"\+")
                       .replace("DATA", demo_data)):
        if "data_path" in overrides:  # several words: the flag is given as a list
            paths = [demo_data if p == "DATA" else p for p in overrides["data_path"]]
            exp = from_argv(base_args(None) + ["--data-path", *paths])
        else:
            exp = experiment(demo_data, **overrides)
        exp.validate(world_size=world, tokenizer_vocab_size=256)


def test_data_prefixes_of_weighted_and_plain_paths():
    assert data_prefixes(["a", "b"]) == ["a", "b"]
    assert data_prefixes(["0.7", "a", "0.3", "b"]) == ["a", "b"]
    assert data_prefixes(["a"]) == ["a"]
