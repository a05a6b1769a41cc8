"""JREG inside Hugging Face training loops, for any causal LM (no megatron-core needed)."""

from megatron_jreg.hf_training.layers import decoder_layers, layer_count
from megatron_jreg.hf_training.regularizer import HFJreg

__all__ = ["HFJreg", "decoder_layers", "layer_count"]
