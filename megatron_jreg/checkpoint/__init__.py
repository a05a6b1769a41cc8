"""Checkpoints: Megatron's directory layout on dist-checkpointing, written and read.

Reading is one pipeline: ``catalog`` (which iterations are whole, which to read), ``trusted``
(the one open of an iteration, through ``safe_pickle``), ``formats`` (what kind of iteration
it is, checked by ``claims``), ``loading`` (the load). ``dist_checkpoint`` saves (in the
background with ``async_save``), ``manifest`` checksums each file, ``save_lock`` keeps one
writer per directory, ``interrupted`` finishes a killed save, ``faults`` says what went wrong.
``model_loader.load_model`` opens an iteration as a model at any TP/PP layout for the tools;
``to_hf`` and ``from_hf`` convert to and from Hugging Face families (``hf_families``).
"""
