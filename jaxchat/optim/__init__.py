"""Muon and the optimizer recipes: parameter groups, learning rates and schedules, chained in optax.partition."""
