"""Build JREG models the way a GPU run does, in a process where the CPU redirection of
megatron_jreg.platform.cpu is NOT active: no megatron-core fix may depend on it.

Run under `torchrun --standalone --nproc_per_node 2 gpu_path_worker.py SPEC.json`. Each case
of the spec names ModelConfig/ParallelConfig fields; the worker builds the case's model
chunks with weights on the CPU (megatron's own use_cpu_initialization), checks what it
built, and runs the parts that need no CUDA: every norm of the stage on this rank's
sequence shard, forward and backward, and through megatron's selective-recompute function
when the layout recomputes layernorm. Writes a JSON report per rank.
"""

import json
import os
import sys

import torch
import torch.distributed as dist


def build_case(case):
    from megatron.core import parallel_state

    from megatron_jreg.config.model import JregConfig, ModelConfig, ParallelConfig
    from megatron_jreg.model.builder import build_model, transformer_config
    from megatron_jreg.model.jreg_layer import JregTracker

    model_cfg = ModelConfig(**case["model"])
    parallel = ParallelConfig(**case.get("parallel", {}))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_stages(model_cfg.num_layers))
    config = transformer_config(model_cfg, parallel)
    config.use_cpu_initialization = True  # weights on the CPU: no CUDA device is needed
    tracker = JregTracker(JregConfig(lam=1.0), model_cfg.num_layers,
                          sequence_parallel=parallel.sequence_parallel)
    return model_cfg, parallel, config, build_model(model_cfg, parallel, tracker, config)


def run_norms(config, chunks, seq_local):
    """Every norm of the stage on a [s_local, 2, h] shard: forward, backward, gradients."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as random_mod

    recompute_norm = (config.recompute_granularity == "selective"
                      and "layernorm" in (config.recompute_modules or []))
    norms, grads_ok, same = 0, True, True
    for chunk in chunks:
        modules = [m for layer in chunk.decoder.layers
                   for m in (layer.input_layernorm, layer.pre_mlp_layernorm)]
        if chunk.decoder.final_layernorm is not None:
            modules.append(chunk.decoder.final_layernorm)
        for norm in modules:
            x = torch.randn(seq_local, 2, config.hidden_size,
                            dtype=next(norm.parameters()).dtype, requires_grad=True)
            norm.zero_grad()
            if recompute_norm:
                # TransformerLayer's selective recompute of layernorm runs the norm through
                # CheckpointWithoutOutputFunction, whose forward reads the helper's fp8 flag
                # (a NameError without TE, unfixed). CheckpointWithoutOutput.checkpoint()
                # around it snapshots the CUDA RNG: a device matter, so it is left out here.
                helper = tensor_parallel.CheckpointWithoutOutput()
                recomputed = random_mod.CheckpointWithoutOutputFunction.apply(norm, helper, x)
                same &= torch.equal(recomputed, norm(x))
            out = norm(x)
            out.float().pow(2).sum().backward()
            grads_ok &= all(p.grad is not None and bool(torch.isfinite(p.grad).all())
                            for p in norm.parameters())
            norms += 1
    return norms, grads_ok and same


def main():
    from megatron_jreg.platform import cpu

    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = {"cpu_redirection_active": cpu.is_active(), "cases": {}}
    for name, case in spec["cases"].items():
        try:
            model_cfg, parallel, config, chunks = build_case(case)
            sp = parallel.sequence_parallel
            norm_params = [p for chunk in chunks for n, p in chunk.named_parameters()
                           if "layernorm" in n]
            tp = parallel.tensor_model_parallel_size
            seq_local = model_cfg.seq_length // tp if sp else model_cfg.seq_length
            norms, grads_ok = run_norms(config, chunks, seq_local)
            report["cases"][name] = {
                "ok": True,
                "chunks": len(chunks),
                "layers": sorted(layer.layer_number for c in chunks for layer in c.decoder.layers),
                "layer_class": sorted({type(layer).__name__ for c in chunks
                                       for layer in c.decoder.layers}),
                "norm_params": len(norm_params),
                "norms_sp_marked": all(getattr(p, "sequence_parallel", False) for p in norm_params)
                                     if sp else None,
                "norms_run": norms,
                "norm_grads_finite": grads_ok,
                "deallocate_pipeline_outputs": bool(config.deallocate_pipeline_outputs),
                "params_on_rank": sum(p.numel() for c in chunks for p in c.parameters()),
                "embedding_rows": [int(c.embedding.word_embeddings.weight.shape[0])
                                   for c in chunks if hasattr(c, "embedding")],
            }
        except Exception as err:  # report, so the test names the case and the error
            report["cases"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        finally:
            chunks = None
    report["cpu_redirection_active_after"] = cpu.is_active()
    with open(os.path.join(spec["out_dir"], f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
