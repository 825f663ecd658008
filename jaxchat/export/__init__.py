"""Models in and out: nanochat's files, Hugging Face transformers, and loading a saved model to evaluate or sample."""
