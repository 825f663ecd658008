"""Causal sliding-window attention.

Query i sees key j iff 0 <= i - j <= window (FlashAttention's window_size=(window, 0)).
Two implementations behind one switch:
- 'cudnn': cuDNN flash attention on GPU, in bfloat16. The window is passed to the kernel, so a
  short window skips the masked blocks and saves compute, not just masks them.
- 'xla': plain XLA with an exact boolean mask; runs anywhere (the CPU default).
Decoding with a KV cache always uses the XLA path with an explicit mask: queries sit at an offset
into the cache, which the kernels' aligned causal mask cannot express.
"""

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn")


def default_implementation(platform: str | None = None) -> str:
    """cuDNN flash attention on NVIDIA GPUs, XLA elsewhere."""
    platform = platform or jax.default_backend()
    return "cudnn" if platform in ("gpu", "cuda") else "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, implementation: str = "xla") -> jax.Array:
    """q: (B, T, H, D); k, v: (B, T, Hkv, D) with H % Hkv == 0 (GQA). Returns (B, T, H, D).

    Scale is 1/sqrt(D). A window of T-1 or more is plain causal attention.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; use one of {IMPLEMENTATIONS}")
    T = q.shape[1]
    local_window = None if window >= T - 1 else (window, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=local_window, implementation=implementation
    )


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_start: jax.Array, window: int) -> jax.Array:
    """Attention of t new queries at absolute positions q_start .. q_start+t-1 over a KV cache.

    q: (B, t, H, D); k_cache, v_cache: (B, S, Hkv, D), already holding the new keys/values.
    Cache slots past the last query are masked by causality, so their (stale) contents never matter.
    """
    t, S = q.shape[1], k_cache.shape[1]
    q_pos = q_start + jnp.arange(t)[:, None]  # (t, 1)
    k_pos = jnp.arange(S)[None, :]  # (1, S)
    delta = q_pos - k_pos
    mask = (delta >= 0) & (delta <= window)  # (t, S)
    return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[None, None], implementation="xla")
