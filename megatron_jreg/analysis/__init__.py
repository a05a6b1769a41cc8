"""Measuring the final-layer jump of trained models: displacement, jump rates, reports.

Import each name from the module that defines it; this package imports nothing, so a tool
that needs one module does not pay for torch, and transformers, matplotlib and megatron's
dataset code load only in the functions that need them. Checkpoint loading and the Hugging
Face export live in :mod:`megatron_jreg.checkpoint`, seed statistics in
:mod:`megatron_jreg.stats`.
"""
