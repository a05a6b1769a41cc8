"""--moe-token-dispatcher-type alltoall against allgather on two ranks under expert
parallelism (EP2: each rank holds 4 of the mixtral-tiny preset's 8 experts), on the CPU
with gloo: the same steps give the same LM loss, penalty, every Psi_l and gradient norm.

The allgather dispatcher gathers every token to every rank; the alltoall dispatcher sends
each token only to the rank holding its expert, through ``all_to_all_single`` with uneven
splits, which is counted here: tokens must cross to the other rank, or the comparison
would not involve the exchange at all. Both runs are set up and trained one after the
other in one two-rank launch (this file, run as a script under torchrun)."""

import json
import os
import subprocess
import sys

import pytest

KINDS = ("allgather", "alltoall")
STEPS = 2  # the second step's numbers follow an update by each run's own gradients


def _worker(out_dir, argv):
    """One rank: each dispatcher's run of ``argv``; its metrics in KIND.jsonl (rank 0), and
    per rank the dispatcher classes, local experts and rows sent to the other rank."""
    import torch.distributed as dist

    from megatron_jreg.commands.train import from_argv
    from megatron_jreg.training.trainer import Trainer

    exchanged = []
    all_to_all_single = dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        if input_split_sizes is not None:
            mine = dist.get_rank(kwargs.get("group"))
            exchanged.append(sum(int(n) for i, n in enumerate(input_split_sizes) if i != mine))
        return all_to_all_single(output, input, output_split_sizes=output_split_sizes,
                                 input_split_sizes=input_split_sizes, **kwargs)

    dist.all_to_all_single = counted
    seen = {}
    for kind in KINDS:
        exchanged.clear()
        trainer = Trainer(from_argv(
            argv + ["--moe-token-dispatcher-type", kind,
                    "--metrics-file", os.path.join(out_dir, f"{kind}.jsonl")]))
        try:
            trainer.setup()
            layers = trainer.model[0].module.decoder.layers
            classes = sorted({type(layer.mlp.token_dispatcher).__name__ for layer in layers})
            local = sorted({len(layer.mlp.experts.local_experts) for layer in layers})
            assert trainer.train() == 0
        finally:
            trainer.close()
        seen[kind] = {"dispatchers": classes, "local_experts": local,
                      "calls": len(exchanged), "sent_to_other_rank": sum(exchanged)}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dispatched(demo_data, tmp_path_factory):
    # (imported here: run as the torchrun script, this file has only its own directory on
    # sys.path, not tests/ where trainer_runs' own imports live)
    from trainer_runs import REPO, base_args, run_env

    out = tmp_path_factory.mktemp("moe_dispatch")
    argv = base_args(demo_data, model_preset="mixtral-tiny", train_iters=STEPS,
                     micro_batch_size=2, global_batch_size=4, expert_model_parallel_size=2)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", os.path.abspath(__file__), str(out)]
    proc = subprocess.run(launcher + argv, cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    metrics = {}
    for kind in KINDS:
        rows = [json.loads(line) for line in open(out / f"{kind}.jsonl")]
        metrics[kind] = [r for r in rows if "lm_loss" in r]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return metrics, ranks


def test_each_run_built_its_dispatcher_over_two_expert_ranks(dispatched):
    _, ranks = dispatched
    for seen in ranks:
        assert seen["allgather"]["dispatchers"] == ["MoEAllGatherTokenDispatcher"]
        assert seen["alltoall"]["dispatchers"] == ["MoEAlltoAllTokenDispatcher"]
        for kind in KINDS:
            assert seen[kind]["local_experts"] == [4]  # 8 experts over EP 2
        # the alltoall run sent tokens to the other rank's experts: per layer and step, its
        # dispatch and combine, forward and backward
        assert seen["alltoall"]["calls"] >= 4 * STEPS * 4
        assert seen["alltoall"]["sent_to_other_rank"] > 0
        assert seen["allgather"]["calls"] == 0


def test_alltoall_trains_as_allgather_does(dispatched):
    metrics, _ = dispatched
    gathered, exchanged = metrics["allgather"], metrics["alltoall"]
    assert [r["iteration"] for r in gathered] == [r["iteration"] for r in exchanged] == [1, 2]
    for a, b in zip(gathered, exchanged):
        for key in ("lm_loss", "jreg_penalty", "R", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (key, a[key], b[key])
        assert b["psi"] == pytest.approx(a["psi"], rel=1e-6, abs=1e-9)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2:])
