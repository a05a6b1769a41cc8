"""JREG in ``transformers.Trainer`` and its subclasses (TRL's ``SFTTrainer`` among them).

:class:`JregTrainerMixin` adds each training batch's :class:`HFJreg` penalty to the loss the
Trainer computes, scaled over gradient-accumulation steps as the Trainer scales that loss, and
adds the window's LM loss, penalty, zeta_L .. zeta_{L-2} and per-layer Psi
(``jreg/psi/layer_XX``) to each training log, which reaches the reporters the user configured.
Evaluation reports the LM loss alone, comparable with a run without JREG.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_jreg.hf_training.regularizer import HFJreg, check_settings


class JregTrainerMixin:
    """Put it before the Trainer class in the bases; its keyword arguments are the JREG
    settings (``jreg_lambda``, ``jreg_alpha``, ``jreg_weighting``, ``jreg_impl``), checked
    when the Trainer is built::

        class JregTrainer(JregTrainerMixin, transformers.Trainer): ...
        trainer = JregTrainer(model=model, args=args, train_dataset=data, jreg_lambda=1.0)

    Each micro-batch's penalty counts ``1 / steps`` of the step's, as in this project's
    trainer; the logged values are means over the window's steps and the data-parallel ranks.
    """

    def __init__(self, *args, jreg_lambda: float = 1.0, jreg_alpha: float = 1.0,
                 jreg_weighting: str = "softmax", jreg_impl: str = "auto", **kwargs):
        # checked before the Trainer is built: a NaN lambda would train a NaN model to the end
        lam, alpha = check_settings(
            jreg_lambda, jreg_alpha, jreg_weighting, jreg_impl, owner=type(self).__name__,
            names=("jreg_lambda", "jreg_alpha", "jreg_weighting", "jreg_impl"))
        self._jreg_settings = dict(lam=lam, alpha=alpha, weighting=jreg_weighting,
                                   impl=jreg_impl)
        self.jreg: Optional[HFJreg] = None
        super().__init__(*args, **kwargs)  # with model_init=, call_model_init hooks its model
        if self.jreg is None:
            self.jreg = HFJreg(self.model, **self._jreg_settings)
        self._jreg_window: Dict[str, object] = {}

    def call_model_init(self, trial=None):
        # Trainer(model_init=...) makes a new model here, in __init__ and again at the start
        # of each train(): the hooks move to it, the model that trains
        model = super().call_model_init(trial)
        if self.jreg is not None:
            self.jreg.remove()
        self.jreg = HFJreg(model, **self._jreg_settings)
        return model

    def train(self, *args, **kwargs):
        # the hooks sit on the layers while the Trainer trains, and come off after: no
        # hidden states stay referenced by them, and the model runs as it came. A second
        # train() puts them back
        self.jreg.attach()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.jreg.remove()

    def compute_loss(self, model, inputs, return_outputs: bool = False,
                     num_items_in_batch: Optional[int] = None):
        if model.training:
            self.jreg.attach()  # a training step called outside train()
        # ask for the outputs only when our caller does: TRL's SFTTrainer (fused LM head)
        # makes them with a second forward under no_grad, whose hidden states would replace
        # the recorded ones and leave the penalty without its gradient
        result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                      num_items_in_batch=num_items_in_batch)
        loss, outputs = result if return_outputs else (result, None)
        if not model.training:
            # evaluation: the LM loss alone, comparable with a run without JREG
            self.jreg.clear()
            return (loss, outputs) if return_outputs else loss
        values = self.jreg.penalty(inputs.get("attention_mask"))
        penalty, lm_loss = values["penalty"], loss.detach()
        if self._loss_is_scaled_for_ga(num_items_in_batch):
            # the Trainer will not divide this loss by the accumulation steps: do it here
            steps = self.current_gradient_accumulation_steps
            penalty = penalty / steps
            # and this micro-batch's loss is its share of the step's (normalized by the
            # tokens of all the step's micro-batches): times the steps, the window's mean
            # over micro-batches is the step's LM loss, as the Trainer's "loss" counts it
            lm_loss = lm_loss * steps
        self._add_to_window(lm_loss, values)
        total = loss + penalty.to(loss.dtype)
        return (total, outputs) if return_outputs else total

    def _loss_is_scaled_for_ga(self, num_items_in_batch) -> bool:
        """The Trainer's own rule (Trainer.training_step) for a loss it leaves undivided."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is not None:
            return bool(scaled)
        return bool((getattr(self, "model_accepts_loss_kwargs", False)
                     and num_items_in_batch is not None)
                    or getattr(self, "compute_loss_func", None) is not None)

    def _add_to_window(self, lm_loss: torch.Tensor, values: Dict[str, torch.Tensor]) -> None:
        w = self._jreg_window
        w["n"] = w.get("n", 0) + 1
        for key, value in (("lm_loss", lm_loss.float()), ("penalty", values["penalty"].detach()),
                           ("psi", values["psi"])):
            w[key] = w[key] + value if key in w else value.clone()

    def _mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over data-parallel ranks (every rank logs at the same step, right after
        the Trainer gathered its own loss), so the reporters on rank 0 see the batch's
        values, not rank 0's rows."""
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None or accelerator.num_processes == 1:
            return values
        return accelerator.reduce(values.to(accelerator.device), reduction="mean").cpu()

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        w = self._jreg_window
        if "loss" in logs and w.get("n"):  # a training log: the window's JREG values
            n = w["n"]
            window = torch.cat([w["lm_loss"].reshape(1), w["penalty"].float().reshape(1),
                                w["psi"].float()]) / n
            window = self._mean_over_ranks(window)
            logs["lm_loss"], logs["jreg_penalty"] = float(window[0]), float(window[1])
            psi = window[2:].tolist()
            logs.update(self.jreg.rates(torch.tensor(psi)))
            logs.update({f"jreg/psi/layer_{layer:02d}": value
                         for layer, value in enumerate(psi, start=1)})
            self._jreg_window = {}
        super().log(logs, *args, **kwargs)
