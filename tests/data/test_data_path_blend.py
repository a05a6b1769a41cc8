"""``--data-path`` is parsed once (``data.datasets.blend.parse_data_path``): the trainer's
prefixes (``batches.data_prefixes``) and the datasets' blend (``GPTDataConfig.blend``)
come from it, and it reads a list as megatron-core's ``get_blend_from_list`` does."""

import pytest

from megatron_jreg.data.datasets.batches import data_prefixes
from megatron_jreg.data.datasets.blend import parse_data_path
from megatron_jreg.data.datasets.gpt import GPTDataConfig

CASES = [
    (["a"], (["a"], None)),
    (["a", "b"], (["a", "b"], None)),
    (["a", "b", "c"], (["a", "b", "c"], None)),
    (["0.7", "a", "0.3", "b"], (["a", "b"], [0.7, 0.3])),
    (["1", "a"], (["a"], [1.0])),
    (["1", "a", "2"], (["1", "a", "2"], None)),  # odd length: every item is a prefix
    (["0.5", "a", "b", "c"], (["0.5", "a", "b", "c"], None)),  # "b" is not a weight
    (["2e-1", "a", "inf", "b"], (["a", "b"], [0.2, float("inf")])),
]


@pytest.mark.parametrize("data_path,expected", CASES)
def test_parse_data_path(data_path, expected):
    assert parse_data_path(data_path) == expected
    assert data_prefixes(data_path) == expected[0]


@pytest.mark.parametrize("data_path,expected", [c for c in CASES if "inf" not in c[0]])
def test_the_blend_is_the_parse(data_path, expected):
    assert GPTDataConfig(data_path=data_path).blend() == expected


@pytest.mark.parametrize("data_path,_", CASES)
def test_as_megatron_core_reads_it(data_path, _):
    from megatron.core.datasets.utils import get_blend_from_list

    assert parse_data_path(data_path) == get_blend_from_list(list(data_path))


def test_a_weight_not_above_zero_is_refused():
    with pytest.raises(ValueError, match="every weight must be a finite number > 0"):
        GPTDataConfig(data_path=["0", "a", "1", "b"])
