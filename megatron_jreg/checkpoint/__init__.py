"""Checkpoints: Megatron's directory layout on dist-checkpointing, written and read.

``dist_checkpoint`` saves and loads an iteration (torn saves, trackers, schedules, RNG),
``manifest`` checks each file's bytes, ``save_lock`` keeps one writer per directory.
"""
