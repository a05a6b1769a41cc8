"""A learning-rate schedule in a checkpoint: megatron's scheduler state under
Megatron-LM's name (``opt_param_scheduler``; earlier saves of ours called it ``scheduler``,
older Megatron-LM ones ``lr_scheduler``), and how a resumed run reconciles it with its
flags (Megatron-LM's rule)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from megatron_jreg.errors import CheckpointError

# the names a checkpoint's schedule is saved under, the one we write first
SCHEDULE_KEYS = ("opt_param_scheduler", "scheduler", "lr_scheduler")


def saved_schedule(state: Optional[Dict]) -> Optional[Dict]:
    """The schedule state in a checkpoint's (common or loaded) state, whatever its name."""
    for key in SCHEDULE_KEYS:
        if state and state.get(key) is not None:
            return state[key]
    return None


SCHEDULER_FLAGS = {  # scheduler state key -> (flag, its samples form when a length, or None)
    "max_lr": ("--lr", None), "min_lr": ("--min-lr", None),
    "lr_warmup_steps": ("--lr-warmup-iters", "--lr-warmup-samples"),
    "lr_decay_steps": ("--lr-decay-iters", "--lr-decay-samples"),
    "lr_decay_style": ("--lr-decay-style", None),
    "wsd_decay_steps": ("--lr-wsd-decay-iters", "--lr-wsd-decay-samples"),
    "lr_wsd_decay_style": ("--lr-wsd-decay-style", None),
    "start_wd": ("--weight-decay", None),
}
WSD_KEYS = ("wsd_decay_steps", "lr_wsd_decay_style")  # compared only where a schedule is WSD


def scheduler_state(scheduler) -> Dict:
    """megatron's scheduler state plus the WSD fields its state_dict leaves out."""
    state = scheduler.state_dict()
    state["wsd_decay_steps"] = scheduler.wsd_decay_steps
    state["lr_wsd_decay_style"] = scheduler.lr_wsd_decay_style
    return state


def scheduler_differences(scheduler, saved: Dict,
                          samples_per_iter: int) -> List[Tuple[str, str, str]]:
    """(flag, the flags' value, the checkpoint's value as a flag) for each schedule value
    that differs; a length is in steps (``--lr-decay-iters 100``) where whole, else in
    samples. The WSD values count only where the flags or the checkpoint decay by WSD."""
    wsd = "WSD" in (scheduler.lr_decay_style, saved.get("lr_decay_style"))
    out = []
    for key, (flag, samples_flag) in SCHEDULER_FLAGS.items():
        if key not in saved or (key in WSD_KEYS and not wsd):
            continue
        mine, theirs = getattr(scheduler, key), saved[key]
        if mine == theirs:
            continue
        if samples_flag and isinstance(mine, int) and isinstance(theirs, int):
            shown = []
            for value in (mine, theirs):
                whole = value % samples_per_iter == 0
                shown.append(f"{flag} {value // samples_per_iter}" if whole
                             else f"{samples_flag} {value}")
            out.append((flag, shown[0], shown[1]))
        else:
            out.append((flag, f"{flag} {mine}", f"{flag} {theirs}"))
    return out


def load_scheduler(scheduler, saved: Dict, mode: str, samples_per_iter: int) -> None:
    """Megatron-LM's rule: ``override`` takes the flags, ``checkpoint`` the checkpoint's
    values, ``strict`` (neither flag) requires them to agree."""
    if mode == "strict":
        diffs = scheduler_differences(scheduler, saved, samples_per_iter)
        if diffs:
            raise CheckpointError(
                "the learning-rate schedule differs from the checkpoint's ("
                + "; ".join(f"{mine} here, {theirs} in the checkpoint" for _, mine, theirs in diffs)
                + "): to continue it pass " + " ".join(theirs for _, _, theirs in diffs)
                + " or --use-checkpoint-opt-param-scheduler; --override-opt-param-scheduler "
                "takes this run's values instead")
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


_ADAM_FLAGS = ("--adam-beta1", "--adam-beta2", "--adam-eps")


def adam_settings(optimizer) -> List[Tuple[float, float, float]]:
    """Each parameter group's (beta1, beta2, eps): this run's before a load, the
    checkpoint's after it (loading an optimizer's state brings back its groups' settings)."""
    return [(*group["betas"], group["eps"]) for group in optimizer.param_groups
            if "betas" in group]


def keep_adam_settings(optimizer, mine: List[Tuple[float, float, float]], mode: str) -> None:
    """After the optimizer's state is loaded: with ``override`` (--override-opt-param-scheduler)
    this run's Adam settings go back into its groups; otherwise a setting the checkpoint was
    trained with other than this run's is an error naming the flags that continue it (a
    resume would train with the checkpoint's while the run records its flags')."""
    theirs = adam_settings(optimizer)
    if mode == "override":
        for group, (beta1, beta2, eps) in zip(
                (g for g in optimizer.param_groups if "betas" in g), mine):
            group["betas"], group["eps"] = (beta1, beta2), eps
        return
    for here, saved in zip(mine, theirs):
        diffs = [(flag, a, b) for flag, a, b in zip(_ADAM_FLAGS, here, saved) if a != b]
        if diffs:
            raise CheckpointError(
                "the optimizer's Adam settings differ from the checkpoint's ("
                + "; ".join(f"{flag} {a:g} here, {flag} {b:g} in the checkpoint"
                            for flag, a, b in diffs)
                + "): to continue it pass " + " ".join(f"{flag} {b:g}" for flag, _, b in diffs)
                + "; --override-opt-param-scheduler takes this run's values instead")
