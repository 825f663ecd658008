"""jaxchat: nanochat's base-model pretraining in JAX / Flax NNX."""
