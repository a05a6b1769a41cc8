"""RMSNorm and LayerNorm for the local (non-Transformer-Engine) layer spec, sequence-parallel aware.

megatron-core 0.16.1's local norms refuse ``--sequence-parallel`` (``WrappedTorchNorm`` asserts
against it; ``FusedLayerNorm`` has no RMSNorm). These are torch's norms with their parameters
marked ``sequence_parallel``, so ``finalize_model_grads`` all-reduces their gradients over TP;
``model.builder`` swaps them in through the layer and block specs, on every device.
"""

from __future__ import annotations

import torch


def _check(config, zero_centered_gamma: bool, kind: str) -> None:
    if config.normalization != kind:
        raise ValueError(f"{kind} built for normalization={config.normalization!r}")
    if config.layernorm_zero_centered_gamma or zero_centered_gamma:
        raise ValueError(f"{kind}: zero-centred gamma is not supported")


def _mark_sequence_parallel(module: torch.nn.Module, config) -> None:
    if config.sequence_parallel:
        for param in module.parameters():
            param.sequence_parallel = True


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor; weight marked for SP.

    Same parameter name (``weight``) and math as the module ``WrappedTorchNorm`` returns,
    so checkpoints written with either load into the other.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "RMSNorm"):
        _check(config, zero_centered_gamma, "RMSNorm")
        # in the model's dtype, as megatron's own layers are built (a bf16 evaluation model
        # has no Float16Module to cast it; fp32 weights under bf16 inputs miss torch's
        # fused kernel)
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        _mark_sequence_parallel(self, config)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` (weight and bias) with megatron's norm constructor; marked for SP.

    Same parameter names and math as ``WrappedTorchNorm`` builds for LayerNorm.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5,
                 persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                 normalization: str = "LayerNorm"):
        _check(config, zero_centered_gamma, "LayerNorm")
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        _mark_sequence_parallel(self, config)


def norm_class(normalization: str) -> type:
    """The local norm for ``--normalization``."""
    return {"RMSNorm": RMSNorm, "LayerNorm": LayerNorm}[normalization]
