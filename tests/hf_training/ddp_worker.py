"""One rank of tests/hf_training/test_hf_ddp.py: JREG on the 2-row batch of
test_hf_penalty.py's ``batch()`` split over 2 gloo ranks, one SGD step (lr 1) per case.

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_worker.py OUT``.
Each rank writes ``OUT/<case>.rank<r>.pt``: the rows it trained on (their input ids), the
penalty and per-layer Psi it computed (or the Trainer logged), its LM loss, the decoder
layers HFJreg found (attribute path, class names) and the full parameters after the step.
The test process computes the references itself, in one process.

Cases (all start from ``model_of("llama")``, seeded: the ranks hold identical weights):

* ``trainer_avg`` / ``trainer_local``: JregTrainer (transformers.Trainer on accelerate's
  MULTI_CPU, which wraps the model in DDP) with ``average_tokens_across_devices`` True /
  False, one row per rank, sequential sampling (rank r gets row r; the rows are recorded
  anyway), HFJreg built by the mixin before the Trainer wraps the model.
* ``trainer_fsdp``: ``trainer_avg`` with ``fsdp=True`` and an FSDP2 ``fsdp_config``; on the
  CPU accelerate runs it as DDP (test_hf_ddp.py's docstring), which the record shows.
* ``ddp``: a plain loop, ``HFJreg(DistributedDataParallel(model))`` (found through ``.module``).
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on each decoder layer and the root;
  HFJreg built before sharding (the hooks sit on the layers whose class fully_shard then
  swaps for ``FSDP<Layer>``); after sharding HFJreg is also built on the sharded model, to
  record which layers it finds there.
* ``fsdp1``: ``FullyShardedDataParallel`` (use_orig_params=False, a FlatParameter per decoder
  layer: each layer becomes a ``FullyShardedDataParallel`` wrapper in the ModuleList), HFJreg
  built on the wrapped model, after wrapping.
"""

import os
import sys

import torch
import torch.distributed as dist
import transformers
from test_hf_penalty import batch, model_of
from test_hf_trainer import JregTrainer, Samples

from megatron_jreg.hf_training import HFJreg

LAM, ALPHA = 0.5, 1.0


class RecordingTrainer(JregTrainer):
    """Records the rows each rank trains on and the Trainer's num_items_in_batch."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append({"input_ids": inputs["input_ids"].detach().clone(),
                          "num_items_in_batch": None if num_items_in_batch is None
                          else float(num_items_in_batch)})
        return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


def full_params(model):
    """{name: full tensor} of ``model`` (FSDP2's DTensor shards gathered)."""
    return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
            for name, value in model.state_dict().items()}


def layers_found(jreg):
    return {"path": jreg.path, "classes": sorted({type(layer).__name__ for layer in jreg.layers})}


def trainer_case(out, name, average_tokens, **fsdp):
    model, _ = model_of("llama")
    ids, mask = batch()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, name), max_steps=1, per_device_train_batch_size=1,
        learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0.0,
        logging_steps=1, optim="sgd", report_to=[], save_strategy="no", use_cpu=True, seed=0,
        train_sampling_strategy="sequential", average_tokens_across_devices=average_tokens,
        disable_tqdm=True, ddp_find_unused_parameters=False, **fsdp)
    trainer = RecordingTrainer(model=model.train(), args=args, train_dataset=Samples(ids, mask),
                               jreg_lambda=LAM, jreg_alpha=ALPHA, jreg_impl="torch")
    trainer.seen = []
    trainer.train()
    [log] = [row for row in trainer.state.log_history if "loss" in row]
    return {"seen": trainer.seen, "log": log, "layers": layers_found(trainer.jreg),
            "wrapper": type(trainer.model_wrapped).__name__,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "fsdp_asked": trainer.args.fsdp_plugin_args is not None,
            "fsdp_plugin_kept": getattr(trainer.accelerator.state, "fsdp_plugin", None) is not None,
            "params": full_params(trainer.model)}


def plain_case(kind, rank):
    model, _ = model_of("llama")
    model.train()
    ids, mask = batch()
    ids, mask = ids[rank:rank + 1], mask[rank:rank + 1]  # rank r trains on row r
    labels = ids.masked_fill(mask == 0, -100)
    found = None
    if kind == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        jreg = HFJreg(wrapped, lam=LAM, alpha=ALPHA, impl="torch")
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        jreg = HFJreg(model, lam=LAM, alpha=ALPHA, impl="torch")  # as the mixin: before wrapping
        for layer in model.model.layers:
            fully_shard(layer)
        wrapped = fully_shard(model)
        after = HFJreg(wrapped, lam=LAM, alpha=ALPHA, impl="torch")
        found = layers_found(after)
        after.remove()
    elif kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        wrapped = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({type(model.model.layers[0])}),
            device_id=torch.device("cpu"), use_orig_params=False)
        jreg = HFJreg(wrapped, lam=LAM, alpha=ALPHA, impl="torch")
    else:
        raise ValueError(kind)
    opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
    out = wrapped(input_ids=ids, attention_mask=mask, labels=labels)
    loss, values = jreg.add_penalty(out.loss, mask)
    loss.backward()
    opt.step()
    if kind == "fsdp1":
        from torch.distributed.fsdp import (
            FullStateDictConfig,
            FullyShardedDataParallel,
            StateDictType,
        )

        with FullyShardedDataParallel.state_dict_type(
                wrapped, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            params = {k: v.detach().clone() for k, v in wrapped.state_dict().items()}
    else:
        params = full_params(model)
    return {"seen": [{"input_ids": ids.clone()}], "lm_loss": float(out.loss.detach()),
            "penalty": float(values["penalty"].detach()), "psi": values["psi"],
            "layers": found or layers_found(jreg), "wrapper": type(wrapped).__name__,
            "params": params}


def main(out):
    rank = int(os.environ["RANK"])
    results = {}
    # the Trainer first: accelerate initializes the gloo process group the plain loops reuse
    results["trainer_avg"] = trainer_case(out, "trainer_avg", True)
    results["trainer_local"] = trainer_case(out, "trainer_local", False)
    # accelerate keeps one AcceleratorState per process: forget it (not the process group)
    # so that the next Trainer's Accelerator takes its FSDP plugin
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()
    results["trainer_fsdp"] = trainer_case(
        out, "trainer_fsdp", True, fsdp=True,
        fsdp_config={"version": 2, "reshard_after_forward": True,
                     "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    assert dist.is_initialized() and dist.get_backend() == "gloo", "accelerate set up no gloo group"
    for kind in ("ddp", "fsdp2", "fsdp1"):
        results[kind] = plain_case(kind, rank)
        dist.barrier()
    for case, result in results.items():
        torch.save(result, os.path.join(out, f"{case}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
