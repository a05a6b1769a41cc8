"""A learning-rate schedule in a checkpoint: megatron's scheduler state under
Megatron-LM's name (``opt_param_scheduler``; earlier saves of ours called it ``scheduler``,
older Megatron-LM ones ``lr_scheduler``), and how a resumed run reconciles it with its
flags (Megatron-LM's rule)."""

from __future__ import annotations

from typing import Dict, List, Optional

from megatron_jreg.errors import CheckpointError

# the names a checkpoint's schedule is saved under, the one we write first
SCHEDULE_KEYS = ("opt_param_scheduler", "scheduler", "lr_scheduler")


def saved_schedule(state: Optional[Dict]) -> Optional[Dict]:
    """The schedule state in a checkpoint's (common or loaded) state, whatever its name."""
    for key in SCHEDULE_KEYS:
        if state and state.get(key) is not None:
            return state[key]
    return None


SCHEDULER_FLAGS = {  # scheduler state key -> (flag, unit: samples per flag unit or None)
    "max_lr": ("--lr", None), "min_lr": ("--min-lr", None),
    "lr_warmup_steps": ("--lr-warmup-iters", "iters"),
    "lr_decay_steps": ("--lr-decay-iters", "iters"), "lr_decay_style": ("--lr-decay-style", None),
    "wsd_decay_steps": ("--lr-wsd-decay-iters", "iters"),
    "lr_wsd_decay_style": ("--lr-wsd-decay-style", None),
    "start_wd": ("--weight-decay", None),
}


def scheduler_state(scheduler) -> Dict:
    """megatron's scheduler state plus the WSD fields its state_dict leaves out."""
    state = scheduler.state_dict()
    state["wsd_decay_steps"] = scheduler.wsd_decay_steps
    state["lr_wsd_decay_style"] = scheduler.lr_wsd_decay_style
    return state


def scheduler_differences(scheduler, saved: Dict, samples_per_iter: int) -> List[str]:
    """'flag: flags give X, the checkpoint Y' for each schedule value that differs."""
    out = []
    for key, (flag, unit) in SCHEDULER_FLAGS.items():
        if key not in saved:
            continue
        mine, theirs = getattr(scheduler, key), saved[key]
        if mine == theirs:
            continue
        if unit and isinstance(mine, int) and isinstance(theirs, int):
            mine, theirs = mine / samples_per_iter, theirs / samples_per_iter
            mine, theirs = (int(v) if float(v).is_integer() else v for v in (mine, theirs))
        out.append(f"{flag} {mine} (the checkpoint's {theirs})")
    return out


def load_scheduler(scheduler, saved: Dict, mode: str, samples_per_iter: int) -> None:
    """Megatron-LM's rule: ``override`` takes the flags, ``checkpoint`` the checkpoint's
    values, ``strict`` (neither flag) requires them to agree."""
    if mode == "strict":
        diffs = scheduler_differences(scheduler, saved, samples_per_iter)
        if diffs:
            raise CheckpointError(
                "the learning-rate schedule differs from the checkpoint's: " + "; ".join(diffs)
                + ". Pass --override-opt-param-scheduler to use the flags or "
                "--use-checkpoint-opt-param-scheduler to keep the checkpoint's")
    scheduler.override_opt_param_scheduler = mode == "override"
    scheduler.use_checkpoint_opt_param_scheduler = mode != "override"
    scheduler.load_state_dict(saved)
    if mode == "override":
        # megatron reads the peak/final lr per parameter group first, and the optimizer's
        # loaded state brought back the checkpoint's
        for group in scheduler.optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group:
                    group[key] = getattr(scheduler, key)
        scheduler.step(increment=0)
    else:
        for key in ("wsd_decay_steps", "lr_wsd_decay_style"):
            if key in saved:
                setattr(scheduler, key, saved[key])
