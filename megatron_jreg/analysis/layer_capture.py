"""Forward hooks that hand each decoder layer's input and output to a JumpAccumulator.

Shared by the Hugging Face and the megatron checkpoint sources: layer ``l``'s input is
``h_{l-1}`` and its output ``h_l``; ``h_L`` gets the final norm only on request, and the
forward stops after layer L (the output layer is not needed).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from megatron_jreg.analysis.jump_accumulator import JumpAccumulator


class _StopForward(Exception):
    """Raised after the last decoder layer."""


def _layer_output(output: object) -> torch.Tensor:
    # megatron and transformers < 5 return a tuple (hidden, ...); transformers >= 5 a tensor
    return output[0] if isinstance(output, (tuple, list)) else output


class LayerCapture:
    """Hooks on ``layers`` (numbered 1..L by ``numbers``) feeding one accumulator per run."""

    def __init__(self, name: str, layers: Sequence[torch.nn.Module], numbers: Sequence[int],
                 final_norm: Optional[torch.nn.Module], include_final_norm: bool):
        self.name = name
        self.num_layers = len(layers)
        self.final_norm = final_norm
        self.include_final_norm = include_final_norm
        self._acc: Optional[JumpAccumulator] = None
        self._mask: Optional[torch.Tensor] = None
        self._layers_seen = 0
        for layer, number in zip(layers, numbers):
            layer.register_forward_hook(self._make_hook(number), with_kwargs=True)

    def _make_hook(self, layer_number: int):
        def hook(module, args, kwargs, output):
            if self._acc is None:  # the model is used outside run()
                return None
            h_prev = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            h_next = _layer_output(output)
            if layer_number == self.num_layers and self.include_final_norm:
                h_next = self.final_norm(h_next)
            self._acc.add(layer_number, h_prev, h_next, self._mask)
            self._layers_seen += 1
            if layer_number == self.num_layers:
                raise _StopForward
            return None

        return hook

    @torch.no_grad()
    def run(self, acc: JumpAccumulator, mask: torch.Tensor, forward: Callable[[], object]) -> None:
        """Call ``forward()`` with the hooks armed; ``mask`` has the hidden states' token shape."""
        self._acc, self._mask, self._layers_seen = acc, mask, 0
        try:
            forward()
        except _StopForward:
            pass
        finally:
            self._acc = self._mask = None
        if self._layers_seen != self.num_layers:
            raise RuntimeError(
                f"{self.name}: {self._layers_seen} of {self.num_layers} decoder layers ran; "
                "the model skips or repeats layers, so h_0..h_L are not a chain"
            )
