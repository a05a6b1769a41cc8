"""A Transformer Engine shaped model and a local-spec one load each other's checkpoints.

Run as ``python te_local_worker.py RUN_SAVE OUT_DIR`` in one process (TP1) or under
torchrun with 2 (TP2). RUN_SAVE is a local-spec run of the trainer. The worker builds the
run's model at TP = world size, local and TE-shaped (megatron_lm_shaped.te_shape: core
attention with Transformer Engine's extra state), loads RUN_SAVE into both, saves the
TE-shaped one with the project's save path, and loads that save into a local and a
TE-shaped model again. Rank 0 prints one JSON line: per load, whether this rank's logits
equal the first local load's on every rank, and the lines the loads printed.
"""

import contextlib
import io
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_lm_shaped import TE_EXTRA_STATE, te_shape  # noqa: E402

from megatron_jreg.checkpoint import dist_checkpoint as ckpt  # noqa: E402
from megatron_jreg.checkpoint import formats  # noqa: E402
from megatron_jreg.checkpoint.loading import load_checkpoint  # noqa: E402
from megatron_jreg.checkpoint.model_loader import eval_model_config  # noqa: E402
from megatron_jreg.checkpoint.run_configs import saved_vocab_rows  # noqa: E402
from megatron_jreg.config.model import ParallelConfig  # noqa: E402
from megatron_jreg.distributed.setup import (  # noqa: E402
    initialize_distributed,
    initialize_model_parallel,
    seed_everything,
)
from megatron_jreg.model.builder import build_model, causal_attention_mask  # noqa: E402


def main():
    root, out_dir = sys.argv[1:]
    initialize_distributed()
    source = formats.read(root)
    configs = source.format.configs
    model_cfg = eval_model_config(configs["model"], saved_vocab_rows(source))
    parallel = ParallelConfig(tensor_model_parallel_size=dist.get_world_size())
    initialize_model_parallel(model_cfg, parallel)
    tokens = torch.arange(2 * 24).reshape(2, 24) % 200
    positions = torch.arange(24).expand(2, 24).contiguous()

    def load(source, te):
        seed_everything(99)  # the weights all come from the checkpoint: another init
        chunks = build_model(model_cfg, parallel, tracker=None)
        if te:
            te_shape(chunks)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            load_checkpoint(source, chunks)
        chunks[0].eval()
        with torch.no_grad():
            logits = chunks[0](tokens, positions, causal_attention_mask(24))
        return chunks, logits, printed.getvalue()

    _, reference, _ = load(formats.read(root), te=False)
    results = {}
    te_chunks, logits, printed = load(formats.read(root), te=True)
    results["te_from_local"] = (logits, printed)
    ckpt.save_checkpoint(out_dir, 4, te_chunks, None, None,
                         source.opened.read_text("run_config.yaml"),
                         {"consumed_samples": 0})
    chunks, logits, printed = load(formats.read(out_dir), te=False)
    results["local_from_te"] = (logits, printed)
    chunks, logits, printed = load(formats.read(out_dir), te=True)
    extra = [m.loaded_extra_state for m in chunks[0].modules() if hasattr(m, "loaded_extra_state")]
    results["te_from_te"] = (logits, printed)
    report = {}
    for name, (logits, printed) in results.items():
        same = torch.tensor([float(torch.equal(logits, reference))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        report[name] = {"equal": bool(same.item()), "printed": printed}
    report["te_extra_state_loaded"] = len(extra) == model_cfg.num_layers and all(
        bytes(e.tolist()) == TE_EXTRA_STATE for e in extra)
    if dist.get_rank() == 0:
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
