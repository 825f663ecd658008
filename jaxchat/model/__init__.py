"""The GPT of nanochat's recipes and what computes with it: attention and its kernels, fp8, the loss head, the KV-cache engine, the bytes a step keeps."""
