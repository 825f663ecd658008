"""The loss head: soft-capped cross-entropy over the vocabulary, in chunks of positions.

For hidden states x (B, T, C) and the unembedding w (C, V), per token:

    z = x @ w                     (float32 accumulation)
    s = cap * tanh(z / cap)       (logit soft cap, cap = 15)
    loss = logsumexp(s) - s[target]          (0 where target == -1)

Materialising s for a whole batch costs B*T*V float32 values (16 GiB for d20 at 32 x 2048 rows and
65,536 tokens), and autodiff keeps several such tensors for the backward pass (z, tanh, exp) plus a
one-hot of the targets. Here the positions are split into chunks of `chunk_len`; the forward pass keeps
only each token's logsumexp, and the backward pass (a custom VJP) recomputes each chunk's logits:

    d loss / d s = softmax(s) - onehot(target)      (onehot as a comparison with an iota, no scatter)
    d s / d z    = 1 - (s / cap)^2
    dx = dz @ w^T,   dw = sum over chunks of x^T @ dz (accumulated in float32)

At most one chunk of (B, chunk_len, V) float32 values lives at a time. The matmuls take x's dtype
(bfloat16 on accelerators) with float32 accumulation, so the logits are more exact than a bf16 matmul
rounded to bf16 (what nanochat's autocast gives) and dw sums over chunks in float32.
"""

from functools import partial

import jax
import jax.numpy as jnp

LOGIT_SOFTCAP = 15.0
DEFAULT_CHUNK_LEN = 128  # positions per chunk: d20 at 32 rows per device -> 1 GiB of float32 logits


def softcap_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """Soft-capped float32 logits of hidden states x (..., C) against w (C, V)."""
    z = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    return LOGIT_SOFTCAP * jnp.tanh(z / LOGIT_SOFTCAP)


def _chunk_len(T: int, chunk_len: int) -> int:
    """The largest divisor of T that is at most chunk_len, so the chunks tile T exactly."""
    c = max(1, min(chunk_len, T))
    while T % c:
        c -= 1
    return c


def _chunks(a: jax.Array, c: int) -> jax.Array:
    """(B, T, ...) -> (T/c, B, c, ...): the chunk axis first, for lax.scan."""
    B, T = a.shape[:2]
    return jnp.moveaxis(a.reshape(B, T // c, c, *a.shape[2:]), 1, 0)


def _unchunk(a: jax.Array) -> jax.Array:
    """(T/c, B, c, ...) -> (B, T, ...)"""
    n, B, c = a.shape[:3]
    return jnp.moveaxis(a, 0, 1).reshape(B, n * c, *a.shape[3:])


def _chunk_stats(x_c, w, targets_c):
    """Per token of one chunk: logsumexp of the capped logits, the target's capped logit, and whether
    the target is the argmax (greedy prediction). Targets of -1 match no column."""
    s = softcap_logits(x_c, w)  # (B, c, V)
    lse = jax.nn.logsumexp(s, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == targets_c[..., None]
    target_logit = jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    return lse, target_logit, jnp.argmax(s, axis=-1) == targets_c


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _token_losses(x, w, targets, chunk_len):
    return _token_losses_fwd(x, w, targets, chunk_len)[0]


def _token_losses_fwd(x, w, targets, chunk_len):
    c = _chunk_len(x.shape[1], chunk_len)

    def body(_, chunk):
        x_c, t_c = chunk
        lse, target_logit, _ = _chunk_stats(x_c, w, t_c)
        return None, (lse, jnp.where(t_c >= 0, lse - target_logit, 0.0))

    _, (lse, losses) = jax.lax.scan(body, None, (_chunks(x, c), _chunks(targets, c)))
    return _unchunk(losses), (x, w, targets, _unchunk(lse))


def _token_losses_bwd(chunk_len, residuals, g):
    x, w, targets, lse = residuals
    c = _chunk_len(x.shape[1], chunk_len)
    w_c = w.astype(x.dtype)

    def body(dw, chunk):
        x_c, t_c, lse_c, g_c = chunk
        s = softcap_logits(x_c, w)
        onehot = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == t_c[..., None]
        weight = jnp.where(t_c >= 0, g_c, 0.0)[..., None]
        ds = (jnp.exp(s - lse_c[..., None]) - onehot) * weight
        dz = (ds * (1 - jnp.square(s / LOGIT_SOFTCAP))).astype(x.dtype)
        dx_c = jnp.dot(dz, w_c.T, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = dw + jnp.einsum("bcd,bcv->dv", x_c, dz, preferred_element_type=jnp.float32)
        return dw, dx_c

    chunks = (_chunks(x, c), _chunks(targets, c), _chunks(lse, c), _chunks(g, c))
    dw, dx = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), chunks)
    return _unchunk(dx), dw.astype(w.dtype), None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def token_losses(x: jax.Array, w: jax.Array, targets: jax.Array, chunk_len: int = DEFAULT_CHUNK_LEN) -> jax.Array:
    """Cross-entropy of each token, float32 (B, T), 0 where targets == -1. x: (B, T, C) final hidden
    states; w: (C, V) unembedding with exactly the vocabulary's columns; targets: (B, T) int."""
    return _token_losses(x, w, targets.astype(jnp.int32), chunk_len)


def token_scores(x: jax.Array, w: jax.Array, targets: jax.Array,
                 chunk_len: int = DEFAULT_CHUNK_LEN) -> tuple[jax.Array, jax.Array]:
    """For evaluation (no gradient): each token's loss and whether the greedy prediction is the target."""
    c = _chunk_len(x.shape[1], chunk_len)
    targets = targets.astype(jnp.int32)

    def body(_, chunk):
        x_c, t_c = chunk
        lse, target_logit, predicted = _chunk_stats(x_c, w, t_c)
        return None, (jnp.where(t_c >= 0, lse - target_logit, 0.0), predicted)

    _, (losses, predicted) = jax.lax.scan(body, None, (_chunks(x, c), _chunks(targets, c)))
    return _unchunk(losses), _unchunk(predicted)
