"""Causal sliding-window attention.

Query i sees key j iff 0 <= i - j <= window (FlashAttention's window_size=(window, 0)).
Three implementations behind one switch:
- 'cudnn': cuDNN flash attention on NVIDIA GPUs, in bfloat16. The window is passed to the kernel, so a
  short window skips the masked blocks and saves compute, not just masks them.
- 'splash': Pallas' splash attention on TPU, the same skipping by a block-sparse mask (jaxchat.model.splash_attention);
  interpreted elsewhere (tests).
- 'xla': plain XLA with an exact boolean mask, in blocks of query rows that skip the keys causality and
  the window hide (blocked_attention); runs anywhere (the CPU default).
Decoding with a KV cache always uses the XLA path with an explicit mask: queries sit at an offset
into the cache, which the kernels' aligned causal mask cannot express.
"""

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn", "splash")


def default_implementation(platform: str | None = None, platform_version: str | None = None) -> str:
    """Splash attention on TPUs, cuDNN flash attention on NVIDIA GPUs, XLA elsewhere: a ROCm GPU's backend
    is 'gpu' too, and its platform version (e.g. 'rocm 60200') tells it apart."""
    if platform is None:
        platform = jax.default_backend()
        platform_version = jax.devices()[0].client.platform_version
    if platform == "tpu":
        return "splash"
    if platform in ("gpu", "cuda") and "rocm" not in (platform_version or "").lower():
        return "cudnn"
    return "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, implementation: str = "xla") -> jax.Array:
    """q: (B, T, H, D); k, v: (B, T, Hkv, D) with H % Hkv == 0 (GQA). Returns (B, T, H, D).

    Scale is 1/sqrt(D). A window of T-1 or more is plain causal attention.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {implementation!r}; use one of {IMPLEMENTATIONS}")
    T = q.shape[1]
    if implementation == "xla":
        return blocked_attention(q, k, v, window)
    if implementation == "splash":
        from jaxchat.model.splash_attention import splash_attention

        return splash_attention(q, k, v, window)
    local_window = None if window >= T - 1 else (window, 0)
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=local_window, implementation=implementation
    )


def query_block_len(T: int) -> int:
    """Rows per query block of blocked_attention: 128 (the fastest of 64, 128, 256 on the CPU at T=512, d4's
    heads), more for long contexts, so that a layer is at most 8 blocks (each is its own ops in the program)."""
    return max(128, -(-T // 8))


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int) -> jax.Array:
    """causal_attention's 'xla' path, in blocks of query rows, each against the keys it can see only:
    [start - window, stop) for queries [start, stop). Plain XLA computes and masks the whole T x T square of
    scores; causality alone masks half of it, a short window more (at T = 512: 44% of an S layer's scores
    and 38% of an L layer's are skipped). Each query's softmax is over the same unmasked keys as before:
    the masked ones added exact zeros, so only the grouping of the row sum's float32 additions changes."""
    T = q.shape[1]
    block = query_block_len(T)
    outputs = []
    for start in range(0, T, block):
        stop = min(T, start + block)
        first_key = max(0, start - window)
        delta = jnp.arange(start, stop)[:, None] - jnp.arange(first_key, stop)[None, :]
        mask = (delta >= 0) & (delta <= window)
        outputs.append(jax.nn.dot_product_attention(q[:, start:stop], k[:, first_key:stop], v[:, first_key:stop],
                                                    mask=mask[None, None], implementation="xla"))
    return jnp.concatenate(outputs, axis=1)


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
