"""SignalFlag.stop_reason's cadence: one process checks its own flags at every step with no
collective; several all-reduce them only every CHECK_INTERVAL iterations and at a save, so
the steps between carry no collective and no wait on the device, and every rank still
stops at the same iteration."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_jreg.training.signals import CHECK_INTERVAL, SignalFlag


class FakeWorld:
    """Two ranks as seen from one: all_reduce takes the MAX with the peer's code."""

    def __init__(self, monkeypatch, peer_code=0.0):
        self.calls = 0
        self.peer_code = peer_code
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        assert op == dist.ReduceOp.MAX
        self.calls += 1
        tensor.clamp_(min=self.peer_code)


def _flag(received=None):
    flag = SignalFlag(enabled=False)
    flag.received = received
    return flag


def test_one_process_stops_at_once_without_a_collective(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a collective in a one-process run")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    for world in (False, True):  # no process group, or one of a single process
        monkeypatch.setattr(dist, "is_initialized", lambda world=world: world)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
        assert _flag().stop_reason("cpu", 3) is None
        assert _flag(15).stop_reason("cpu", 3) == "signal"
        assert _flag().stop_reason("cpu", 3, time_is_up=True) == "time"
        assert _flag(15).stop_reason("cpu", 3, time_is_up=True) == "signal"


def test_several_processes_agree_only_every_interval_and_at_a_save(monkeypatch):
    world = FakeWorld(monkeypatch)
    flag = _flag(15)
    items = []
    real_item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: items.append(1) or real_item(t))
    for it in range(1, CHECK_INTERVAL):
        assert flag.stop_reason("cpu", it, time_is_up=True) is None
    assert (world.calls, len(items)) == (0, 0)  # no collective, no wait on non-check steps
    assert flag.stop_reason("cpu", CHECK_INTERVAL) == "signal"
    assert (world.calls, len(items)) == (1, 1)
    assert flag.stop_reason("cpu", 3, at_save=True) == "signal"  # a saved step: checked
    assert flag.stop_reason("cpu") == "signal"  # no iteration: checked now
    assert world.calls == 3


def test_a_peers_signal_or_time_limit_is_named_on_this_rank(monkeypatch):
    FakeWorld(monkeypatch, peer_code=2.0)
    assert _flag().stop_reason("cpu", 2 * CHECK_INTERVAL) == "signal"
    FakeWorld(monkeypatch, peer_code=1.0)
    assert _flag().stop_reason("cpu", CHECK_INTERVAL) == "time"
    assert _flag(15).stop_reason("cpu", CHECK_INTERVAL) == "signal"
    FakeWorld(monkeypatch, peer_code=0.0)
    assert _flag().stop_reason("cpu", CHECK_INTERVAL) is None


# (iteration at which rank 1 alone is signalled, iterations saved, where both stop)
CASES = [(3, (), CHECK_INTERVAL), (CHECK_INTERVAL, (), CHECK_INTERVAL),
         (CHECK_INTERVAL + 1, (), 2 * CHECK_INTERVAL), (3, (5,), 5)]


def _rank_loops(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    for case, (signalled_at, saves, _) in enumerate(CASES):
        flag = _flag()
        stopped = None
        for it in range(1, 4 * CHECK_INTERVAL):
            if rank == 1 and it == signalled_at:
                flag.received = 15  # one rank only, as Slurm may signal one task
            if flag.stop_reason("cpu", it, at_save=it in saves):
                stopped = it
                break
        results[(case, rank)] = stopped
    dist.destroy_process_group()


def test_two_gloo_ranks_stop_at_the_same_iteration(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_rank_loops, args=(str(tmp_path / "init"), results), nprocs=2)
    for case, (signalled_at, _, stop) in enumerate(CASES):
        assert (results[(case, 0)], results[(case, 1)]) == (stop, stop), CASES[case]
        assert stop - signalled_at < CHECK_INTERVAL  # honoured within the interval
