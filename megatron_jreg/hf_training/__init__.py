"""JREG inside Hugging Face training loops, for any causal LM (no megatron-core needed)."""

from megatron_jreg.hf_training.layers import decoder_layers, layer_count
from megatron_jreg.hf_training.regularizer import HFJreg
from megatron_jreg.hf_training.trainer import JregTrainerMixin

__all__ = ["HFJreg", "JregTrainerMixin", "decoder_layers", "layer_count"]
