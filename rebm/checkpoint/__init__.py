"""Checkpoint files: model weights (universal loader, atomic writes) and training states."""
