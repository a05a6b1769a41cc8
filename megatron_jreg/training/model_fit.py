"""Whether the model a run describes fits the memory here: its parameters and their bytes
per model-parallel rank, against the device's memory (``platform.device.memory_capacity``).
The trainer refuses a model whose weights alone cannot fit before it builds anything; the
out-of-memory line (``commands.train``) names the model's size when it is the cause."""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron_jreg.model import weight_shapes as ws
from megatron_jreg.platform.device import memory_capacity


@dataclasses.dataclass(frozen=True)
class Misfit:
    line: str  # the model's size, the memory here and the fix
    weights_alone: bool  # its weights alone exceed the memory (no run of it can start)


def model_fit(experiment) -> Optional[Misfit]:
    """Why the model of ``experiment`` cannot fit (its parameters, their bytes, the memory
    here), or None when it fits for training (then activations are what may run out)."""
    model, p = experiment.model, experiment.parallel
    split = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    count = ws.parameter_count(model)
    weights = count * ws.bytes_per_parameter(model, training=False) / split
    training = count * ws.bytes_per_parameter(model, training=True) / split
    capacity = memory_capacity()
    if training <= capacity:
        return None
    per_rank = f" per model-parallel rank (of {split})" if split > 1 else ""
    held = (f"{ws.gib(weights)} of weights{per_rank}, about {ws.gib(training)} with "
            "gradients and Adam's state")
    alone = weights > capacity
    what = "the model does not fit" if alone else "the model does not fit for training"
    return Misfit(f"{what}: its {ws.size_words(count)} parameters are {held}, more than the "
                  f"{ws.gib(capacity)} here; lower --num-layers or --hidden-size, or split it "
                  "with --tensor-model-parallel-size/--pipeline-model-parallel-size over more "
                  "devices", alone)
