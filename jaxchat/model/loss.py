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

With fp8 (nanochat's fp8 lm_head, jaxchat.model.fp8): x and w are quantised to e4m3 once, over the whole
tensor, and the forward pass keeps those (a quarter of float32) instead of x and w; each chunk's dz is
quantised to e5m2 with its own scale; z, dx and dw come from fp8 matmuls dequantised by their scales.
"""

from functools import partial

import jax
import jax.numpy as jnp

from jaxchat.model import fp8

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


def _chunk_stats(s, targets_c):
    """Per token of one chunk of capped logits s (B, c, V): their logsumexp, the target's capped logit, and
    whether the target is the argmax (greedy prediction). Targets of -1 match no column."""
    lse = jax.nn.logsumexp(s, axis=-1)
    hit = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == targets_c[..., None]
    target_logit = jnp.sum(jnp.where(hit, s, 0.0), axis=-1)
    return lse, target_logit, jnp.argmax(s, axis=-1) == targets_c


def _head_operands(x, w, fp8_on: bool):
    """What the forward pass keeps of x and w: themselves, or (with fp8) their e4m3 quantisations, each
    with one scale for the whole tensor (jaxchat.model.fp8), as nanochat's fp8 lm_head saves for its backward."""
    if not fp8_on:
        return (x, None), (w, None)
    return fp8.quantize(x, fp8.E4M3), fp8.quantize(w, fp8.E4M3)


def _capped_logits(x_c, w, inv_x, inv_w):
    """Soft-capped float32 logits of one chunk from _head_operands' values."""
    if inv_x is None:
        return softcap_logits(x_c, w)
    z = fp8.scaled_dot(x_c, inv_x, w, inv_w, ((2,), (0,)), jnp.float32, fp8.FORWARD_PRECISION)
    return LOGIT_SOFTCAP * jnp.tanh(z / LOGIT_SOFTCAP)


def _logit_gradients(s, lse_c, t_c, g_c, x_c, w, w_c, inv_x, inv_w, x_dtype):
    """(dx_c, dw_c) of one chunk: the gradients of Σ g·loss over its tokens, from its capped logits s and
    their logsumexp; g_c per token, or one for all (targets of -1 get none)."""
    onehot = jax.lax.broadcasted_iota(jnp.int32, s.shape, s.ndim - 1) == t_c[..., None]
    weight = jnp.where(t_c >= 0, g_c, 0.0)[..., None]
    ds = (jnp.exp(s - lse_c[..., None]) - onehot) * weight
    dz = (ds * (1 - jnp.square(s / LOGIT_SOFTCAP))).astype(x_dtype)
    if inv_x is None:
        dx_c = jnp.dot(dz, w_c.T, preferred_element_type=jnp.float32).astype(x_dtype)
        return dx_c, jnp.einsum("bcd,bcv->dv", x_c, dz, preferred_element_type=jnp.float32)
    q_dz, inv_dz = fp8.quantize(dz, fp8.E5M2)
    dx_c = fp8.scaled_dot(q_dz, inv_dz, w, inv_w, ((2,), (1,)), x_dtype, fp8.BACKWARD_PRECISION)
    return dx_c, fp8.scaled_dot(x_c, inv_x, q_dz, inv_dz, ((0, 1), (0, 1)), jnp.float32, fp8.BACKWARD_PRECISION)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _token_losses(x, w, targets, chunk_len, fp8_dtypes):
    return _token_losses_fwd(x, w, targets, chunk_len, fp8_dtypes)[0]


def _token_losses_fwd(x, w, targets, chunk_len, fp8_dtypes):
    c = _chunk_len(x.shape[1], chunk_len)
    (x, inv_x), (w, inv_w) = _head_operands(x, w, fp8_dtypes is not None)

    def body(_, chunk):
        x_c, t_c = chunk
        lse, target_logit, _ = _chunk_stats(_capped_logits(x_c, w, inv_x, inv_w), t_c)
        return None, (lse, jnp.where(t_c >= 0, lse - target_logit, 0.0))

    _, (lse, losses) = jax.lax.scan(body, None, (_chunks(x, c), _chunks(targets, c)))
    return _unchunk(losses), (x, inv_x, w, inv_w, targets, _unchunk(lse))


def _token_losses_bwd(chunk_len, fp8_dtypes, residuals, g):
    """With fp8, dz is quantised to e5m2 chunk by chunk: the full (B, T, V) gradient of the logits, whose
    amax nanochat's tensorwise scale reads, never exists here. A chunk's scale is at least as fine."""
    x, inv_x, w, inv_w, targets, lse = residuals
    x_dtype, w_dtype = fp8_dtypes or (x.dtype, w.dtype)
    c = _chunk_len(x.shape[1], chunk_len)
    w_c = w.astype(x_dtype) if inv_x is None else None  # cast once, outside the scan

    def body(dw, chunk):
        x_c, t_c, lse_c, g_c = chunk
        s = _capped_logits(x_c, w, inv_x, inv_w)
        dx_c, dw_c = _logit_gradients(s, lse_c, t_c, g_c, x_c, w, w_c, inv_x, inv_w, x_dtype)
        return dw + dw_c, dx_c

    chunks = (_chunks(x, c), _chunks(targets, c), _chunks(lse, c), _chunks(g, c))
    dw, dx = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), chunks)
    return _unchunk(dx), dw.astype(w_dtype), None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss_sum_over(x, w, targets, divisor, chunk_len, fp8_dtypes):
    return _loss_sum_over_fwd(x, w, targets, divisor, chunk_len, fp8_dtypes)[0]


def _loss_sum_over_fwd(x, w, targets, divisor, chunk_len, fp8_dtypes):
    """The gradients are computed here, with the loss, from each chunk's logits computed once: 3 matmuls
    of the head's size instead of token_losses' 4 (its backward recomputes the logits). What the backward
    pass keeps is then dx and dw themselves (the size of x and of w), not x and each token's logsumexp."""
    x_dtype, w_dtype = fp8_dtypes or (x.dtype, w.dtype)
    c = _chunk_len(x.shape[1], chunk_len)
    (xq, inv_x), (wq, inv_w) = _head_operands(x, w, fp8_dtypes is not None)
    w_c = wq.astype(x_dtype) if inv_x is None else None
    weight = 1.0 / divisor  # each token's in Σ loss / divisor, as autodiff of that division gives it

    def body(dw, chunk):
        x_c, t_c = chunk
        s = _capped_logits(x_c, wq, inv_x, inv_w)
        lse, target_logit, _ = _chunk_stats(s, t_c)
        dx_c, dw_c = _logit_gradients(s, lse, t_c, weight, x_c, wq, w_c, inv_x, inv_w, x_dtype)
        return dw + dw_c, (jnp.where(t_c >= 0, lse - target_logit, 0.0), dx_c)

    chunks = (_chunks(xq, c), _chunks(targets, c))
    dw, (losses, dx) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), chunks)
    return jnp.sum(_unchunk(losses)) / divisor, (_unchunk(dx), dw.astype(w_dtype), divisor)


def _loss_sum_over_bwd(chunk_len, fp8_dtypes, residuals, g):
    """g is 1 where this is the loss a gradient is taken of (jax.grad's seed): dx and dw are then returned
    as computed, to the bit; any other g multiplies them."""
    dx, dw, divisor = residuals
    return (dx * g).astype(dx.dtype), (dw * g).astype(dw.dtype), None, jnp.zeros_like(divisor)


_loss_sum_over.defvjp(_loss_sum_over_fwd, _loss_sum_over_bwd)


def loss_sum_over(x: jax.Array, w: jax.Array, targets: jax.Array, divisor: jax.Array,
                  chunk_len: int = DEFAULT_CHUNK_LEN, *, fp8: bool = False) -> jax.Array:
    """Σ token_losses / divisor, a float32 scalar (divisor: the number of valid targets for the mean, 1 for
    the sum), with the gradients of x and w computed in the forward pass: the maths of token_losses'
    backward, each chunk's logits computed once instead of twice (3 matmuls of the head's size, not 4). Against
    autodiff through token_losses(...).sum() / divisor: the same operations on the same values, the loss to
    the bit, the gradients equal or an ulp of float32 apart where XLA fuses the elementwise part of the
    other program otherwise (contracting a multiply and an add into one rounding). For training losses; per-token
    cotangents (a test's vjp) take token_losses. The divisor gets no gradient."""
    fp8_dtypes = (jnp.dtype(x.dtype), jnp.dtype(w.dtype)) if fp8 else None
    return _loss_sum_over(x, w, targets.astype(jnp.int32), jnp.asarray(divisor, jnp.float32), chunk_len, fp8_dtypes)


def token_losses(x: jax.Array, w: jax.Array, targets: jax.Array, chunk_len: int = DEFAULT_CHUNK_LEN, *,
                 fp8: bool = False) -> jax.Array:
    """Cross-entropy of each token, float32 (B, T), 0 where targets == -1. x: (B, T, C) final hidden
    states; w: (C, V) unembedding with exactly the vocabulary's columns; targets: (B, T) int.
    fp8: the three matmuls of the head in fp8 with tensorwise scales (jaxchat.model.fp8; dz's per chunk)."""
    fp8_dtypes = (jnp.dtype(x.dtype), jnp.dtype(w.dtype)) if fp8 else None
    return _token_losses(x, w, targets.astype(jnp.int32), chunk_len, fp8_dtypes)


def token_scores(x: jax.Array, w: jax.Array, targets: jax.Array,
                 chunk_len: int = DEFAULT_CHUNK_LEN) -> tuple[jax.Array, jax.Array]:
    """For evaluation (no gradient): each token's loss and whether the greedy prediction is the target."""
    c = _chunk_len(x.shape[1], chunk_len)
    targets = targets.astype(jnp.int32)

    def body(_, chunk):
        x_c, t_c = chunk
        lse, target_logit, predicted = _chunk_stats(softcap_logits(x_c, w), t_c)
        return None, (jnp.where(t_c >= 0, lse - target_logit, 0.0), predicted)

    _, (losses, predicted) = jax.lax.scan(body, None, (_chunks(x, c), _chunks(targets, c)))
    return _unchunk(losses), _unchunk(predicted)
