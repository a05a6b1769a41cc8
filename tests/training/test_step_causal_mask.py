"""forward_backward with the causal mask built once (model/builder.causal_attention_mask's
cache) gives the losses and gradients of a mask built anew for every micro-batch, and no
step writes into the shared mask."""

import pytest
import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
from megatron_jreg.distributed.setup import (
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model.builder import build_model, causal_attention_mask, transformer_config
from megatron_jreg.model.jreg_layer import JregTracker
from megatron_jreg.training import step

SEQ, MICRO, VOCAB = 16, 2, 128


def _model(backend):
    model_cfg = ModelConfig.from_preset("tiny", vocab_size=VOCAB, seq_length=SEQ,
                                        attention_backend=backend)
    parallel = ParallelConfig()
    initialize_distributed()
    initialize_model_parallel(model_cfg, parallel)
    seed_everything(1234)
    config = transformer_config(model_cfg, parallel)
    tracker = JregTracker(JregConfig(lam=1.0), model_cfg.num_layers)
    chunks = build_model(model_cfg, parallel, tracker, config)
    ddp = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
    chunks = [DistributedDataParallel(config, ddp, chunk) for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, tracker


def _batches():
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=gen)
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                    "loss_mask": torch.ones(MICRO, SEQ),
                    "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)})
    return out


def _steps(chunks, tracker):
    results = []
    for _ in range(2):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        result = step.forward_backward(chunks, _batches(), SEQ, MICRO, tracker)
        grads = [p.main_grad.clone() for p in chunks[0].parameters()]
        results.append((result["lm_loss"], result["penalty"], grads))
    return results


# local: megatron-core's attention, which reads the mask (SDPA takes is_causal instead)
@pytest.mark.parametrize("backend", ["local", "auto"])
def test_a_shared_mask_trains_as_fresh_ones(backend, monkeypatch):
    chunks, tracker = _model(backend)
    shared = _steps(chunks, tracker)
    mask = causal_attention_mask(SEQ, device="cpu")
    assert torch.equal(mask[0, 0], torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))
    built = []

    def fresh(seq_length, device=None):
        built.append(seq_length)
        return torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool, device=device),
                          1)[None, None]

    monkeypatch.setattr(step, "causal_attention_mask", fresh)
    anew = _steps(chunks, tracker)
    assert len(built) == 4  # one per micro-batch
    for (loss_a, pen_a, grads_a), (loss_b, pen_b, grads_b) in zip(shared, anew):
        assert (loss_a, pen_a) == (loss_b, pen_b)
        for a, b in zip(grads_a, grads_b):
            assert torch.equal(a, b)
