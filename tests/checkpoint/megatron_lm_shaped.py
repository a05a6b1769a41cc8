"""Checkpoints shaped as Megatron-LM (core_v0.16.1) and Transformer Engine write them, made
with megatron-core alone, independently of the project's save path.

:func:`write_megatron_lm_checkpoint` follows Megatron-LM's ``save_checkpoint`` for
``--ckpt-format torch_dist``: its ``generate_state_dict`` (``args``, ``checkpoint_version``
3.0, ``iteration``, ``model``, ``optimizer``, ``opt_param_scheduler``, a sharded ``rng_state``
of one entry per (PP, TP) rank, replicated over data-parallel ranks), plus
``num_floating_point_operations_so_far``, the content metadata of
``_build_sharded_state_dict_metadata`` and the tracker written after every rank finished.
Nothing of this project's own files is written (no run config, manifest or marker).

:func:`te_shape` turns a local-spec model into one whose core attention carries extra state
the way Transformer Engine's ``DotProductAttention`` does (an ``_extra_state`` entry per
layer), the one entry by which a TE-built GPT's checkpoint differs from a local-spec one.

Run as a script (one process or under torchrun) it sets up the trainer from the flags after
``--`` (which load a checkpoint of ours), then writes that state Megatron-LM's way::

    python megatron_lm_shaped.py TARGET {none,dp_reshardable,fully_reshardable} \
        {local,te,local-norng} -- FLAGS
"""

import argparse
import os
import random
import sys

import numpy as np
import torch

TE_EXTRA_STATE = b"te-fp8-meta"


def te_shape(chunks):
    """Give every core-attention module Transformer Engine's extra state (in place)."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    shaped = 0
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not name.endswith("core_attention"):
                continue
            base = type(module)

            class TEShaped(base):
                def get_extra_state(self):
                    return torch.frombuffer(bytearray(TE_EXTRA_STATE), dtype=torch.uint8)

                def set_extra_state(self, state):
                    self.loaded_extra_state = state

                def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
                    return make_sharded_tensors_for_checkpoint(
                        {"_extra_state": self.get_extra_state()}, prefix, {}, sharded_offsets)

            module.__class__ = TEShaped
            shaped += 1
    assert shaped, "no core_attention module found"
    return shaped


def megatron_lm_namespace(trainer):
    """The args Megatron-LM's arguments.py leaves after validation for this run's model
    (the names of megatron/training/arguments.py, written out here by hand)."""
    from megatron.core import parallel_state as ps

    m, p, t = trainer.cfg.model, trainer.cfg.parallel, trainer.train_cfg
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    world = torch.distributed.get_world_size()
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads, group_query_attention=True,
        num_query_groups=m.query_groups, kv_channels=m.hidden_size // m.num_attention_heads,
        max_position_embeddings=m.max_positions, seq_length=m.seq_length,
        position_embedding_type="rope", use_rotary_position_embeddings=True,
        add_position_embedding=False, rotary_base=m.rotary_base, rotary_percent=1.0,
        rotary_interleaved=False, normalization="RMSNorm", norm_epsilon=m.norm_epsilon,
        swiglu=True, squared_relu=False, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=False, apply_layernorm_1p=False,
        apply_query_key_layer_scaling=False, attention_dropout=0.0, hidden_dropout=0.0,
        num_experts=None, moe_router_topk=2, spec=None, hybrid_override_pattern=None,
        # Megatron-LM pads to a multiple of this x TP
        make_vocab_size_divisible_by=m.make_vocab_size_divisible_by // tp,
        padded_vocab_size=m.padded_vocab_size(), tokenizer_type="ByteTokenizer",
        tokenizer_model=None, vocab_size=m.vocab_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        context_parallel_size=1, sequence_parallel=p.sequence_parallel, world_size=world,
        data_parallel_size=ps.get_data_parallel_world_size(),
        use_distributed_optimizer=trainer.cfg.optim.use_distributed_optimizer,
        bf16=m.bf16, fp16=m.fp16, params_dtype=torch.float32, transformer_impl="local",
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.train_iters, seed=t.seed, lr=trainer.cfg.optim.lr,
        consumed_train_samples=trainer.consumed_samples, skipped_train_samples=0,
        consumed_valid_samples=0, ckpt_format="torch_dist", use_dist_ckpt=True,
        no_save_optim=False, no_save_rng=False, data_parallel_random_init=False,
    )


def megatron_lm_rng_state():
    """Megatron-LM's get_rng_state for torch_dist, without expert parallelism."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.empty(0, dtype=torch.uint8),  # a CPU run has no CUDA state
             "rng_tracker_states": get_cuda_rng_tracker().get_states()}
    return ShardedObject(
        "rng_state", [state],
        (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
        replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def write_megatron_lm_checkpoint(trainer, target, sharding, rng=True):
    """Save the trainer's state under ``target`` as Megatron-LM does (collective);
    ``rng`` False: as with Megatron-LM's --no-save-rng."""
    from megatron.core import dist_checkpointing

    metadata = {}
    if sharding != "none":
        metadata["distrib_optim_sharding_type"] = sharding
        if sharding == "fully_reshardable":
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    metadata.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    iteration = trainer.iteration
    state = {"args": megatron_lm_namespace(trainer), "checkpoint_version": 3.0,
             "iteration": iteration}
    for i, chunk in enumerate(trainer.model):
        key = "model" if len(trainer.model) == 1 else f"model{i}"
        state[key] = chunk.module.sharded_state_dict(metadata=dict(metadata))
    state["optimizer"] = trainer.optimizer.sharded_state_dict(state, metadata=dict(metadata))
    state["opt_param_scheduler"] = trainer.scheduler.state_dict()
    if rng:
        state["rng_state"] = megatron_lm_rng_state()
    else:
        state["args"].no_save_rng = True
    state["num_floating_point_operations_so_far"] = 1234.5
    path = os.path.join(target, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(state, path, content_metadata=metadata)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(target, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def main(argv):
    split = argv.index("--")
    target, sharding, spec = argv[:split]
    # the training tests' helper that builds a trainer from flags
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "training"))
    from set_up_trainer import set_up

    with set_up(argv[split + 1:]) as run:
        if spec == "te":
            te_shape(run.trainer.model)
        write_megatron_lm_checkpoint(run.trainer, target, sharding, rng=spec != "local-norng")
        if torch.distributed.get_rank() == 0:
            print(f"wrote iteration {run.trainer.iteration} consumed "
                  f"{run.trainer.consumed_samples}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
