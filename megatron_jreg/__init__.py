"""megatron-jreg: Llama pretraining on megatron-core with the JREG jump regularizer."""

__version__ = "0.1.0"
