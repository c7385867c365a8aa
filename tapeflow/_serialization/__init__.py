"""Checkpoints: metadata, orbax access and atomic saves, save and restore."""
