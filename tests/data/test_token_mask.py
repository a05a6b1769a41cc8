"""JREG's token mask from the data: GPTDataset's padding is excluded from Psi, nothing else.

megatron-core pads a sample that runs past the end of its split (the last validation
sample when partial sequences are kept) and maps the padding to token id 0, visible only
through ``loss_mask``, which also drops the last real token's target. The dataset class
the trainer builds adds ``token_mask``: False exactly at the padded input positions.
"""

import numpy as np
import torch

from megatron_jreg.data.datasets.gpt import token_masked_gpt_dataset_class
from megatron_jreg.data.tokenizers.build import build_tokenizer

SEQ = 16


def _dataset(tmp_path, doc_lengths, pad_partial=True):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tok = build_tokenizer("ByteTokenizer")
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    gen = np.random.default_rng(0)
    for n in doc_lengths:  # byte ids 0..255 and EOD, never the pad id
        doc = gen.integers(0, 256, n - 1).tolist() + [tok.eod]
        builder.add_document(np.array(doc, dtype=np.uint16), [n])
    builder.finalize(prefix + ".idx")
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=SEQ, blend=([prefix], None), split="0,1,0",
        path_to_cache=str(tmp_path / "cache"), tokenizer=tok, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=True,
        drop_last_partial_validation_sequence=not pad_partial)
    _, valid, _ = BlendedMegatronDatasetBuilder(
        token_masked_gpt_dataset_class(), [None, None, None], lambda: True, config).build()
    return valid, sum(doc_lengths)


def test_padding_and_only_padding_is_masked(tmp_path):
    valid, total = _dataset(tmp_path, [23, 9, 31, 14])  # 77 tokens: 4 full samples + 12
    samples = [valid[i] for i in range(len(valid))]
    assert len(samples) == 5
    padded = [s for s in samples if not bool(s["token_mask"].all())]
    assert len(padded) == 1  # samples are shuffled: the partial one is somewhere
    last = padded[0]
    # each sample reads SEQ + 1 tokens starting every SEQ tokens: the last holds the rest
    real = total - (len(samples) - 1) * SEQ
    assert real < SEQ
    expected = torch.arange(SEQ) < real
    assert torch.equal(last["token_mask"], expected)
    # megatron's loss mask also drops the last real token (its target is padding) and EOD
    # targets (eod_mask_loss): the token mask must not follow it there
    assert last["loss_mask"][real - 1] == 0 and last["token_mask"][real - 1]
    eods = [(s["tokens"] == 256) & (torch.arange(SEQ) < real if s is last else True)
            for s in samples]
    assert sum(int(e.sum()) for e in eods) >= 3
    assert all(bool(s["token_mask"][e].all()) for s, e in zip(samples, eods))
    # the padded positions are the ones megatron rewrote to token 0
    assert bool((last["tokens"][~expected] == 0).all())


def test_the_class_keeps_megatrons_cache_identity(tmp_path):
    """Same samples as megatron's own GPTDataset, and the same sample-index cache name."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    valid, _ = _dataset(tmp_path, [40, 40, 40])
    assert type(valid).__name__ == "GPTDataset" and isinstance(valid, GPTDataset)
    plain = GPTDataset.__getitem__(valid, 1)
    ours = valid[1]
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        assert torch.equal(plain[key], ours[key]), key


def test_trainer_batches_carry_the_mask_only_when_something_is_padded():
    from megatron_jreg.training.trainer import Trainer

    class Data:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            mask = torch.ones(SEQ, dtype=torch.bool)
            if i == 3:
                mask[10:] = False
            return {"tokens": torch.full((SEQ,), i), "labels": torch.zeros(SEQ, dtype=torch.long),
                    "loss_mask": torch.ones(SEQ), "position_ids": torch.arange(SEQ),
                    "token_mask": mask}

    trainer = Trainer.__new__(Trainer)
    trainer.train_cfg = type("T", (), {"micro_batch_size": 2})()
    trainer.num_microbatches, trainer.dp_size, trainer.dp_rank = 2, 1, 0
    trainer.device = torch.device("cpu")
    first, second = trainer._batches(Data(), 0)
    assert "token_mask" not in first  # nothing padded: every token counts (the fast path)
    assert second["token_mask"].shape == (2, SEQ)
    assert int((~second["token_mask"]).sum()) == SEQ - 10
