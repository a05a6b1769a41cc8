"""Run megatron-core 0.16.1 on CPU with the gloo backend.

megatron-core assumes CUDA in about fifteen places. On a CPU run (tests, CI, the README's
demo) :func:`activate` (called by ``distributed.setup``) redirects each of them; on a GPU
run it is never called. Every patch names the megatron file it answers to; the redirections
are process-global and idempotent. Fixes of megatron-core bugs live in :mod:`.mcore_fixes`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_ACTIVE = False

# torch factories that megatron calls with device="cuda" or device=torch.cuda.current_device()
# (empty_like: dist_checkpointing/exchange_utils.py, the fully parallel load's buffers).
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "empty_like")


def is_active() -> bool:
    return _ACTIVE


def _names_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a bare device index means a CUDA ordinal
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _Stream:
    """A CUDA stream on the CPU: CPU work runs in program order on one thread, so making a
    stream, waiting for one and recording or waiting on its events are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return _Event()


class _Event:
    """A CUDA event on the CPU: complete when recorded."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _Stream()


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _names_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            # pinned host memory is for copies to a GPU (models/common/embeddings/rope_utils.py,
            # get_pos_emb_on_this_cp_rank: its CP chunk ids, then .cuda()); without one
            # PyTorch refuses to pin
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    wrapper._megatron_jreg_cpu = True
    return wrapper


def _patch_torch_devices() -> None:
    # optimizer/optimizer.py (found_inf, _scale), optimizer/clip_grads.py (total_norm),
    # pipeline_parallel/schedules.py (loss tensors), distributed buffers: device="cuda".
    # torch's `with torch.device(...)` mode knows its factories by identity, from a list it
    # builds once: built here, it holds torch's own factories, which the wrappers call, so
    # the mode still places them (transformers builds models under torch.device("meta");
    # built after the patch, RoPE buffers of a later from_pretrained held garbage)
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "_megatron_jreg_cpu", False):
            setattr(torch, name, _redirect_device(fn))
    # Used as device=... in distributed/param_and_grad_buffer.py and
    # models/common/embeddings/rotary_pos_embedding.py (inv_freq).
    torch.cuda.current_device = lambda: torch.device("cpu")
    # pipeline_parallel/p2p_communication.py and dist_checkpointing save/load synchronize.
    torch.cuda.synchronize = lambda *args, **kwargs: None
    # optimizer/distrib_optimizer.py moves checkpoint state with .cuda() (fully_reshardable).
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    # transformer/moe/token_dispatcher.py (the alltoall dispatcher) makes a side stream for
    # its device-to-host copies and synchronizes with it through an event.
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *args, **kwargs: _CURRENT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # optimizer/optimizer.py, optimizer/distrib_optimizer.py and optimizer/clip_grads.py
    # dispatch on param.type() == 'torch.cuda.FloatTensor' / 'torch.cuda.BFloat16Tensor'
    # and raise on anything else: report CPU tensors under their CUDA type names.
    original_type = torch.Tensor.type
    if not getattr(original_type, "_megatron_jreg_cpu", False):

        def tensor_type(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None:
                name = original_type(self)
                if name.startswith("torch.cuda."):
                    return name
                return name.replace("torch.", "torch.cuda.", 1)
            return original_type(self, dtype, non_blocking, **kwargs)

        tensor_type._megatron_jreg_cpu = True
        torch.Tensor.type = tensor_type


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """tensor_parallel/random.py keeps named CUDA generator states (model-parallel
        dropout/init streams); here the same named states are CPU generator states. The
        seed each stream was added with is kept too: a checkpoint carries the CUDA form of
        the streams beside them (checkpoint.rng_state)."""

        def reset(self):
            super().reset()
            self.seed_of = {}

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"cuda rng state {name} already exists")
            self.seeds_.add(seed)
            self.seed_of[name] = seed
            generator = torch.Generator()
            generator.manual_seed(seed)
            self.states_[name] = generator.get_state()

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"cuda rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    # initialize_rng_tracker() would otherwise replace the CPU tracker with a CUDA one.
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # CheckpointFunction snapshots the CUDA RNG for recompute; the CPU RNG and the tracker
    # states are snapshotted separately by the same code, so the CUDA part is empty.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def _patch_sharded_tensor() -> None:
    # dist_checkpointing/exchange_utils.py (the fully parallel load) makes the buffers it
    # exchanges with ShardedTensor.init_data("cuda"), whose init_fn defaults to torch.empty
    # as it was when mapping.py was imported (not the factory wrapped above).
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    init_data = ShardedTensor.init_data
    if getattr(init_data, "_megatron_jreg_cpu", False):
        return

    @functools.wraps(init_data)
    def cpu_init_data(self, device, init_fn=torch.empty):
        return init_data(self, "cpu" if _names_cuda(device) else device, init_fn)

    cpu_init_data._megatron_jreg_cpu = True
    ShardedTensor.init_data = cpu_init_data


def _patch_moe_dispatcher() -> None:
    # transformer/moe/token_dispatcher.py (the alltoall dispatcher) copies its split sizes
    # to the host as numpy arrays through moe_utils.maybe_move_tensor_to_cpu, which leaves a
    # tensor already on the CPU a tensor; torch.distributed.all_to_all_single takes the
    # numpy array and refuses the tensor: on the CPU the same arrays.
    from megatron.core.transformer.moe import token_dispatcher

    move = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(move, "_megatron_jreg_cpu", False):
        return

    @functools.wraps(move)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megatron_jreg_cpu = True
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def activate() -> None:
    """Apply every CPU redirection (idempotent). Call before building models/optimizers.

    It applies no megatron-core fix: those come from ``build_model`` and
    ``initialize_distributed`` on every device, so CPU runs (CI) take the GPU runs' path."""
    global _ACTIVE
    if _ACTIVE:
        return
    _patch_torch_devices()
    _patch_rng()
    _patch_sharded_tensor()
    _patch_moe_dispatcher()
    _ACTIVE = True
