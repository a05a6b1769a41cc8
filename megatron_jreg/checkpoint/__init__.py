"""Checkpoints: Megatron's directory layout on dist-checkpointing, written and read.

Reading is one pipeline: ``catalog`` (which iterations of a save directory are whole, which
to read), ``trusted`` (the one open of an iteration and the only reader of its files),
``formats`` (what kind of iteration it is), ``loading`` (the load). ``dist_checkpoint``
saves, ``manifest`` checks each file's bytes, ``save_lock`` keeps one writer per directory,
``faults`` says what went wrong. ``model_loader.load_model`` opens an iteration as a model
at any TP/PP layout for the tools; ``to_hf`` and ``from_hf`` move models to and from
Hugging Face (docs/design.md, "Checkpoints as one pipeline").
"""
