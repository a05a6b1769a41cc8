"""RMSNorm for the local (non-Transformer-Engine) layer spec, sequence-parallel aware.

megatron-core 0.16.1's local spec builds its norms with ``WrappedTorchNorm``
(``megatron/core/transformer/torch_norm.py:32``), which asserts
``not config.sequence_parallel``; its block-level final norm is ``FusedLayerNorm`` when
Apex is installed (``transformer/transformer_block.py:63``), which has no RMSNorm. So a
``--sequence-parallel`` run without Transformer Engine dies at model build on any device.

Sequence parallelism needs nothing from the norm's arithmetic: each TP rank normalises
its own slice of the sequence. It needs the weight marked ``sequence_parallel`` so that
``finalize_model_grads`` all-reduces its gradient over the TP group (each rank saw only
its tokens). :class:`RMSNorm` is swapped in through the layer and block specs
(``model/builder.py``), on every device.
"""

from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor; weight marked for SP.

    Same parameter name (``weight``) and math as the module ``WrappedTorchNorm`` returns,
    so checkpoints written with either load into the other.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm":
            raise ValueError(f"RMSNorm built for normalization={config.normalization!r}")
        if config.layernorm_zero_centered_gamma or zero_centered_gamma:
            raise ValueError("RMSNorm: zero-centred gamma is not supported")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in self.parameters():
                param.sequence_parallel = True
