"""Runs on disk: the Orbax checkpoint manager, a run's directory and its lock, step metadata, damage, staged files."""
