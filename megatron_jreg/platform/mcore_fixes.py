"""Workarounds for megatron-core 0.16.1 bugs and missing optional packages, on every device.

:func:`apply` (idempotent) runs every fix in :data:`FIXES`; it is called by
``model.builder.build_model`` and ``distributed.setup.initialize_distributed``, whatever the
device. Each fix names the megatron-core line it answers to and is tested in
``tests/platform``; docs/design.md lists them with what they hit.
"""

from __future__ import annotations

import queue

import torch

from megatron_jreg.platform.checkpoint_writers import fix_writers_die_with_parent

_APPLIED = False


def fix_checkpoint_without_output_fp8() -> None:
    """``CheckpointWithoutOutput.__init__(fp8=False)`` stores ``self.fp8 = fp8 is not None``,
    i.e. True (``tensor_parallel/random.py:636``), and its forward then calls Transformer
    Engine's ``FP8GlobalStateManager`` (line 589): a NameError without TE under selective
    recompute of ``layernorm`` or ``mlp``. Without TE there is no FP8, so fp8 is False."""
    from megatron.core.tensor_parallel import random as mrandom

    cls = mrandom.CheckpointWithoutOutput
    if getattr(cls.__init__, "_megatron_jreg_fix", False):
        return
    original_init = cls.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if not mrandom.HAVE_TE:
            self.fp8 = False

    init._megatron_jreg_fix = True
    cls.__init__ = init


def fix_checkpoint_writer_queue() -> None:
    """The dist-checkpointing writer collects results through a spawn-context
    ``Manager().Queue()`` (``dist_checkpointing/strategies/filesystem_async.py:54``), which
    starts a server process that re-imports ``__main__`` (a second copy of the training
    script's imports, and a failure for ``python -c`` or stdin). Our saves are synchronous:
    the writer runs in this process, so an in-process queue carries the results. (An async
    save, whose writer is another process, puts megatron-core's kind of queue back for its
    run: ``checkpoint.async_save``.)"""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def _fresh_state_dict(optimizer) -> dict:
    """The state_dict of an optimizer that has not stepped yet (no Adam state)."""
    inner = optimizer.optimizer.state_dict()
    state = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
    for group in state["optimizer"]["param_groups"]:
        del group["params"]
        group["step"] = 0
    if optimizer.grad_scaler:
        state["grad_scaler"] = optimizer.grad_scaler.state_dict()
    return state


def fix_distributed_optimizer_checkpoints() -> None:
    """Three checkpoint bugs of ``DistributedOptimizer`` on the torch-Adam path (no Apex/TE);
    each is a no-op when Apex or TE provides the optimizer."""
    from megatron.core.optimizer import distrib_optimizer as do

    cls = do.DistributedOptimizer
    if getattr(cls.state_dict, "_megatron_jreg_fix", False):
        return

    # (1) state_dict() asserts every param already holds an Adam 'step' (line 641), so
    # building the sharded state dict to *load into* a fresh optimizer dies with a bare
    # AssertionError.
    original_state_dict = cls.state_dict

    def state_dict(self):
        if not do.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            return _fresh_state_dict(self)
        return original_state_dict(self)

    # (2) _set_main_param_and_optimizer_states (line 911) copies every live Adam key
    # including 'step': fully_reshardable loads raise KeyError: 'step', dp_reshardable
    # silently resets the step to 0; and it copy_()s into views of leaf params with grad
    # enabled. load_state_dict already set the right step from param_groups: keep it.
    original_set_states = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if (not do.HAVE_APEX_OR_TE
                and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8):
            group_index, order = self.model_param_group_index_map[model_param]
            live = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][order]]
            if "step" in live:
                tensors = dict(tensors, step=live["step"])
        with torch.no_grad():
            return original_set_states(self, model_param, tensors)

    # (3) load_state_dict puts ONE step tensor into every param's state (line 820); torch
    # Adam increments it in place once per param, so bias correction drifts after a resume.
    original_load = cls.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        if not do.HAVE_APEX_OR_TE:
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()

    state_dict._megatron_jreg_fix = True
    cls.state_dict = state_dict
    cls._set_main_param_and_optimizer_states = set_states
    cls.load_state_dict = load_state_dict


def fix_moe_router_without_te() -> None:
    """``moe_utils`` imports ``te_general_gemm`` only when Transformer Engine imports
    (``transformer/moe/moe_utils.py:22-39``) but the router's gating GEMM tests
    ``te_general_gemm is not None`` unguarded (lines 1192 and 1225): every mixture-of-experts
    forward without TE is a NameError. Without TE the name is None, which selects the
    function's own torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


FIXES = (fix_checkpoint_without_output_fp8, fix_checkpoint_writer_queue,
         fix_writers_die_with_parent, fix_distributed_optimizer_checkpoints,
         fix_moe_router_without_te)


def apply() -> None:
    """Apply every fix (idempotent). Called before any model or optimizer is built."""
    global _APPLIED
    if _APPLIED:
        return
    for fix in FIXES:
        fix()
    _APPLIED = True


def is_applied() -> bool:
    return _APPLIED
