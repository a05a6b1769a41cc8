"""Checkpoints: Megatron's directory layout on dist-checkpointing, written and read.

``dist_checkpoint`` saves and loads an iteration (torn saves, trackers, schedules, RNG),
``manifest`` checks each file's bytes, ``save_lock`` keeps one writer per directory.
``model_loader.load_model`` opens an iteration as a model at any TP/PP layout for the
tools (one process is its TP1 PP1 case), and ``to_hf`` writes it as a Hugging Face
``LlamaForCausalLM`` directory (``tools/convert_to_hf.py``).
"""
