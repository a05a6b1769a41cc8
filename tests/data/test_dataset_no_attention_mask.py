"""The GPT samples carry no [s, s] attention mask (Megatron-LM builds one per sample unless
--no-create-attention-mask-in-dataloader; the trainer builds its own causal mask, so here
it is never built): the other fields equal the ones megatron-core gives with the mask, and
a long sample (s = 8192: the mask would be 268 MB) comes without it."""

import pytest
from test_indexed_dataset_check import build

from megatron_jreg.data.datasets.gpt import GPTDataConfig, build_gpt_datasets
from megatron_jreg.data.tokenizers.build import ByteTokenizer

FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


def _samples(prefix, cache, seq_length, n, **flags):
    config = GPTDataConfig(data_path=[prefix], split="100,0,0", seq_length=seq_length,
                           cache_dir=str(cache), **flags)
    train, _, _ = build_gpt_datasets(config, ByteTokenizer(), n)
    return [train[i] for i in range(n)]


@pytest.mark.parametrize("flags", [{}, {"eod_mask_loss": True, "reset_position_ids": True}])
def test_samples_have_no_mask_and_the_same_fields(tmp_path, monkeypatch, flags):
    prefix = build(tmp_path, "a", 60)
    ours = _samples(prefix, tmp_path / "c1", 64, 6, **flags)
    assert all("attention_mask" not in s for s in ours)
    import megatron.core.datasets.gpt_dataset as gpt_dataset

    real = gpt_dataset.GPTDatasetConfig
    monkeypatch.setattr(gpt_dataset, "GPTDatasetConfig",
                        lambda **kw: real(**{**kw, "create_attention_mask": True}))
    masked = _samples(prefix, tmp_path / "c2", 64, 6, **flags)
    assert masked[0]["attention_mask"].shape == (1, 64, 64)  # megatron-core's own
    for a, b in zip(ours, masked):
        for key in FIELDS:
            assert a[key].equal(b[key]), key


def test_long_sample_has_no_mask(tmp_path):
    prefix = build(tmp_path, "a", 60)
    (sample,) = _samples(prefix, tmp_path / "c", 8192, 1)
    assert "attention_mask" not in sample and sample["tokens"].shape == (8192,)
