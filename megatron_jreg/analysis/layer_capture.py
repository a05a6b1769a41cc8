"""Forward hooks that hand each decoder layer's input and output to a JumpAccumulator.

The one capture of every source: Hugging Face models, and our checkpoints on one process
or spread over a torchrun world. Layer ``l``'s input is ``h_{l-1}`` and its output
``h_l``; ``h_L`` gets the final norm only on request. A source hooks the layers it holds
(all of them on one process, its pipeline stage's under torchrun) by their global 1-based
numbers, and passes the token mask in the layout of the hidden states it sees. A model
spread over devices (``--device-map``) hands over pairs whose halves live on different
devices: both go to the device of ``h_l`` before they are combined.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

from megatron_jreg.analysis.jump_accumulator import JumpAccumulator


class _StopForward(Exception):
    """Raised after the last decoder layer."""


def _layer_output(output: object) -> torch.Tensor:
    # megatron and transformers < 5 return a tuple (hidden, ...); transformers >= 5 a tensor
    return output[0] if isinstance(output, (tuple, list)) else output


class LayerCapture:
    """Hooks on ``layers`` ((global number, module) pairs) feeding one accumulator per run.

    ``stop_after_last`` ends the forward after layer L (the output layer is not needed);
    a forward driven by megatron's pipeline schedule must run to its end instead.
    """

    def __init__(
        self,
        name: str,
        layers: Sequence[Tuple[int, torch.nn.Module]],
        num_layers: int,
        final_norm: Optional[torch.nn.Module],
        include_final_norm: bool,
        stop_after_last: bool = True,
    ):
        self.name = name
        self.num_layers = num_layers
        self.num_local = len(layers)
        self.final_norm = final_norm
        self.include_final_norm = include_final_norm
        self.stop_after_last = stop_after_last
        self._acc: Optional[JumpAccumulator] = None
        self._mask: Optional[torch.Tensor] = None
        self._layers_seen = 0
        for number, layer in layers:
            layer.register_forward_hook(self._make_hook(int(number)), with_kwargs=True)

    def _make_hook(self, layer_number: int):
        def hook(module, args, kwargs, output):
            if self._acc is None:  # the model is used outside run()
                return None
            h_prev = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            h_next = _layer_output(output)
            if layer_number == self.num_layers and self.include_final_norm:
                h_next = self.final_norm(h_next)
            # Under a device map (accelerate) a layer's input can still be on the previous
            # layer's device (its hook moves it only inside the call), and the final norm
            # can sit on another device: the pair and the mask meet on h_l's device.
            h_prev = h_prev.to(h_next.device)
            mask = self._mask.to(h_next.device)
            if mask.shape != h_prev.shape[:-1]:
                raise RuntimeError(
                    f"layer {layer_number}: hidden states {tuple(h_prev.shape)} do not match "
                    f"the token mask {tuple(mask.shape)}"
                )
            self._acc.add(layer_number, h_prev, h_next, mask)
            self._layers_seen += 1
            if self.stop_after_last and layer_number == self.num_layers:
                raise _StopForward
            return None

        return hook

    @torch.no_grad()
    def run(self, acc: JumpAccumulator, mask: torch.Tensor, forward: Callable[[], object]) -> None:
        """Call ``forward()`` (one batch) with the hooks armed.

        ``mask``: bool, the token shape of the hidden states the hooked layers see
        (``[b, s]`` for HF, this rank's ``[s(/tp), b]`` for megatron).
        """
        self._acc, self._mask, self._layers_seen = acc, mask, 0
        try:
            forward()
        except _StopForward:
            pass
        finally:
            self._acc = self._mask = None
        if self._layers_seen != self.num_local:
            raise RuntimeError(
                f"{self.name}: {self._layers_seen} of {self.num_local} decoder layers ran; "
                "the model skips or repeats layers, so h_0..h_L are not a chain"
            )
