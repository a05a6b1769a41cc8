"""Fixes for megatron-core 0.16.1 bugs on the path without Apex or Transformer Engine.

They bite CPU runs and GPU users without those packages alike (torch.optim.Adam under
``DistributedOptimizer``), so :func:`apply` is called by every run; each fix is a no-op
when Apex or TE provides the optimizer. All of them concern checkpoint state of
``megatron/core/optimizer/distrib_optimizer.py``.
"""

from __future__ import annotations

import torch

_APPLIED = False


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


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.optimizer import distrib_optimizer as do

    cls = do.DistributedOptimizer

    # (1) state_dict() asserts every param already holds an Adam 'step', so building the
    # sharded state dict to *load into* a fresh optimizer dies with a bare AssertionError.
    original_state_dict = cls.state_dict

    def state_dict(self):
        if not do.HAVE_APEX_OR_TE and len(self.optimizer.state) == 0:
            return _fresh_state_dict(self)
        return original_state_dict(self)

    cls.state_dict = state_dict

    # (2) _set_main_param_and_optimizer_states copies every live Adam key including 'step':
    # fully_reshardable loads raise KeyError: 'step', dp_reshardable silently resets the
    # step to 0; and it copy_()s into views of leaf params with grad enabled. load_state_dict
    # already set the right step from param_groups, so keep the live one.
    original_set_states = cls._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if not do.HAVE_APEX_OR_TE and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, order = self.model_param_group_index_map[model_param]
            live = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][order]]
            if "step" in live:
                tensors = dict(tensors, step=live["step"])
        with torch.no_grad():
            return original_set_states(self, model_param, tensors)

    cls._set_main_param_and_optimizer_states = set_states

    # (3) load_state_dict puts ONE step tensor into every param's state; torch Adam
    # increments it in place once per param, so bias correction drifts after a resume.
    original_load = cls.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        if not do.HAVE_APEX_OR_TE:
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()

    cls.load_state_dict = load_state_dict
    _APPLIED = True
