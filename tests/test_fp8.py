"""fp8 training (jaxchat/fp8.py): tensorwise quantisation, saturation and the three matmuls against a
float64 NumPy version of nanochat's scaling maths (nanochat/fp8.py at 92d63d4), the fp8 loss head,
non-finite inputs, the step lowered for CUDA, a d2 train step against the same step without fp8, and
an fp8-trained checkpoint against one trained without."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxchat import fp8
from jaxchat.loss import LOGIT_SOFTCAP, token_losses
from jaxchat.run import RunSettings, SettingsError

U32 = 2.0 ** -24  # float32 unit roundoff
E5M2_U = 2.0 ** -3  # e5m2 unit roundoff (2 mantissa bits): a normal value rounds within 2^-3 of itself
# (mantissa bits, smallest normal exponent, largest finite value) of the two fp8 formats
FORMATS = {"e4m3": (3, -6, 448.0), "e5m2": (2, -14, 57344.0)}
JAX_TYPES = {"e4m3": fp8.E4M3, "e5m2": fp8.E5M2}


def np_round_fp8(v: np.ndarray, fmt: str) -> np.ndarray:
    """Round float64 values within [-max, max] to the nearest fp8 value of `fmt`, ties to even: the
    spacing at |v| is 2^(e - mantissa bits) with e = floor(log2 |v|), never below the subnormals'."""
    mant, min_exp, _ = FORMATS[fmt]
    e = np.floor(np.log2(np.maximum(np.abs(v), 2.0 ** min_exp)))
    quantum = 2.0 ** (e - mant)
    return np.round(v / quantum) * quantum  # np.round: half to even


def np_quantize(x: np.ndarray, fmt: str) -> tuple[np.ndarray, float]:
    """nanochat's _to_fp8: scale = max / max(amax, 1e-12) in float64 rounded to float32, x * scale in
    float32, clamp, round to fp8; the inverse scale is float32's reciprocal."""
    fp8_max = FORMATS[fmt][2]
    x32 = np.asarray(x, np.float32)
    scale = np.float32(fp8_max / max(float(np.abs(x32.astype(np.float64)).max()), 1e-12))
    scaled = (x32 * scale).astype(np.float64)  # a float32 product, as torch's x.float() * scale
    return np_round_fp8(np.clip(scaled, -fp8_max, fp8_max), fmt), float(np.float32(1) / scale)


def spread(rng, shape) -> np.ndarray:
    """Values over ~12 binades, so that both formats' subnormals and the top of the range are hit."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 1, size=shape)).astype(np.float32)


# ---- quantisation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_is_nanochats_tensorwise_scaling(fmt):
    """Exactly equal: every step (the float32 division, the float32 product, the clamp, the rounding to
    fp8) is one correctly rounded IEEE operation, so both sides have only one possible result."""
    x = spread(np.random.default_rng(0), (64, 48))
    q, inv = fp8.quantize(jnp.asarray(x), JAX_TYPES[fmt])
    q_ref, inv_ref = np_quantize(x, fmt)
    assert q.dtype == JAX_TYPES[fmt]
    np.testing.assert_array_equal(np.asarray(q, np.float64), q_ref)
    assert float(inv) == inv_ref
    assert np.abs(np.asarray(q, np.float64)).max() == FORMATS[fmt][2]  # amax maps onto the largest value


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_saturates(fmt):
    """A value whose float32 product with the scale lands above the largest fp8 value is clamped to it.
    Without the clamp the cast is not saturating: e4m3fn has no inf and turns 464 into NaN, e5m2 turns
    61440 into inf."""
    fp8_max = FORMATS[fmt][2]
    candidates = np.float32(1.0) + np.arange(1, 20000, dtype=np.float32) * np.spacing(np.float32(1.0))
    over = [a for a in candidates if a * (np.float32(fp8_max) / a) > fp8_max]  # float32 arithmetic throughout
    assert over, "no float32 amax overshoots: pick other candidates"
    a = over[0]
    q, _ = fp8.quantize(jnp.asarray([a, -a, a / 3], jnp.float32), JAX_TYPES[fmt])
    assert np.asarray(q, np.float64)[:2].tolist() == [fp8_max, -fp8_max]
    unclamped = jnp.asarray([fp8_max * 1.08, fp8_max * 1.5]).astype(JAX_TYPES[fmt])
    assert not np.isfinite(np.asarray(unclamped, np.float64)).any()


# ---- the three matmuls ----------------------------------------------------------------------------
def product_bound(a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """|error| of a float32-accumulated product of exact fp8 values a @ b (each fp8 x fp8 product is exact
    in float32: 4 x 4 significant bits), times a float32 scale and rounded once more: the sum of K terms
    in float32 is within K u |a| @ |b| (Higham's gamma_K), and the scale product and the final rounding
    add 2 u; a margin of one float32 ulp at the smallest normal covers exact zeros."""
    k = a.shape[-1]
    return (k + 2) * U32 * (np.abs(a) @ np.abs(b)) * scale + np.finfo(np.float32).tiny


def test_matmul_forward_and_both_gradients():
    rng = np.random.default_rng(1)
    x, w, g = spread(rng, (3, 16, 64)), spread(rng, (64, 32)), spread(rng, (3, 16, 32))
    y, vjp = jax.vjp(fp8.matmul, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32,) * 3

    qx, ix = np_quantize(x.reshape(-1, 64), "e4m3")  # activations and weights: e4m3
    qw, iw = np_quantize(w, "e4m3")
    qg, ig = np_quantize(g.reshape(-1, 32), "e5m2")  # the gradient: e5m2
    expected = {
        "forward": (qx @ qw * (ix * iw), product_bound(qx, qw, ix * iw), y.reshape(-1, 32)),
        "dgrad": (qg @ qw.T * (ig * iw), product_bound(qg, qw.T, ig * iw), dx.reshape(-1, 64)),
        "wgrad": (qx.T @ qg * (ix * ig), product_bound(qx.T, qg, ix * ig), dw),
    }
    for name, (ref, bound, got) in expected.items():
        err = np.abs(np.asarray(got, np.float64) - ref)
        assert (err <= bound).all(), f"{name}: worst error {err.max():.3g}, bound there {bound[err.argmax() // bound.shape[1]]}"
        # the fp8 rounding itself is far larger than float32's: the comparison can tell the formats apart
        assert np.abs(ref).max() > 1e3 * bound.max()


def test_matmul_of_zeros_is_exactly_zero():
    """amax = 0: the scale is 448e12 (nanochat's floor 1e-12), the fp8 values are zeros and the product is
    exactly 0, with no NaN from 0/0; the weight's gradient (x^T g) is exactly 0 as well."""
    w = spread(np.random.default_rng(2), (128, 32))
    y, vjp = jax.vjp(fp8.matmul, jnp.zeros((8, 128)), jnp.asarray(w))
    dx, dw = vjp(jnp.ones((8, 32)))
    assert not np.asarray(y).any() and not np.asarray(dw).any()
    assert np.isfinite(np.asarray(dx)).all() and np.asarray(dx).any()


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_operand_makes_the_whole_product_nan(bad):
    """The documented outcome (jaxchat/fp8.py): an inf or NaN anywhere in an operand gives NaN in every
    element of that matmul's result (never a finite value saturated at the fp8 maximum), so the loss turns
    NaN at once. Forward: a bad activation; backward: a bad gradient element poisons dx and dw."""
    rng = np.random.default_rng(3)
    x, w = spread(rng, (8, 128)), spread(rng, (128, 32))
    x_bad = x.copy()
    x_bad[2, 5] = bad
    assert np.isnan(np.asarray(fp8.matmul(jnp.asarray(x_bad), jnp.asarray(w)))).all()
    g = np.ones((8, 32), np.float32)
    g[1, 1] = bad
    _, vjp = jax.vjp(fp8.matmul, jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    assert np.isnan(np.asarray(dx)).all() and np.isnan(np.asarray(dw)).all()


# ---- the loss head --------------------------------------------------------------------------------
def test_fp8_loss_head_against_numpy():
    """token_losses(fp8=True): x and w quantised to e4m3 once over the whole tensor, each chunk's dz to
    e5m2 with its own scale (jaxchat/loss.py). The reference does the same in float64 from the same
    float32 inputs. Bounds: z's error is product_bound's; the loss moves by at most 2 max|dz| (its
    gradient in z, softmax - onehot, has an L1 norm <= 2), plus float32's logsumexp over V terms; dx and dw
    from the e5m2 dz: dz itself is float32 in jaxchat and float64 here, so the two may round to
    neighbouring e5m2 values (and their amax, so their scales, differ): the bound allows a whole e5m2
    rounding of dz on each side, carried through the matmul, plus product_bound. (That the gradient is
    e5m2 and not e4m3 is checked on the lowered program: test_the_step_lowered_for_cuda_has_fp8_dots.)"""
    B, T, C, V, chunk = 2, 16, 128, 96, 8
    rng = np.random.default_rng(4)
    x, w = spread(rng, (B, T, C)) * 8, spread(rng, (C, V)) * 8
    targets = rng.integers(0, V, size=(B, T))
    targets[0, 3] = -1
    losses, vjp = jax.vjp(lambda a, b: token_losses(a, b, jnp.asarray(targets), chunk, fp8=True), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.ones((B, T), jnp.float32))

    qx, ix = np_quantize(x.reshape(-1, C), "e4m3")
    qw, iw = np_quantize(w, "e4m3")
    z = qx @ qw * (ix * iw)
    z_bound = product_bound(qx, qw, ix * iw)
    s = LOGIT_SOFTCAP * np.tanh(z / LOGIT_SOFTCAP)
    lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    t = targets.reshape(-1)
    valid = t >= 0
    loss_ref = np.where(valid, lse - s[np.arange(B * T), np.maximum(t, 0)], 0.0)
    loss_bound = 2 * z_bound.max() + (V + 4) * U32 * np.abs(s).max()
    assert np.abs(np.asarray(losses).reshape(-1) - loss_ref).max() <= loss_bound

    p = np.exp(s - lse[:, None])
    onehot = np.arange(V)[None, :] == t[:, None]
    dz = ((p - onehot) * valid[:, None] * (1 - (s / LOGIT_SOFTCAP) ** 2)).reshape(B, T // chunk, chunk, V)
    dx_ref, dx_bound = np.zeros((B, T // chunk, chunk, C)), np.zeros((B, T // chunk, chunk, C))
    dw_ref, dw_bound = np.zeros((C, V)), np.zeros((C, V))
    qx_chunks = qx.reshape(B, T // chunk, chunk, C)
    for k in range(T // chunk):
        qdz, idz = np_quantize(dz[:, k].reshape(-1, V), "e5m2")
        dx_ref[:, k] = (qdz @ qw.T * (idz * iw)).reshape(B, chunk, C)
        qx_k = qx_chunks[:, k].reshape(-1, C)
        dw_ref += qx_k.T @ qdz * (ix * idz)
        # jaxchat's dz is float32: within (V + 8) u of float64's (|dz| <= 1; logsumexp over V terms, exp,
        # tanh); quantising either side moves it by at most E5M2_U of itself (or half the smallest
        # subnormal, 2^-17 scaled), and its amax, so its scale, differs too: dz's error, element by element
        dz_err = 2 * E5M2_U * np.abs(dz[:, k].reshape(-1, V)) + (V + 8) * U32 + 2 * 2.0 ** -17 * idz
        dx_bound[:, k] = (dz_err @ np.abs(qw.T) * iw + product_bound(qdz, qw.T, idz * iw)).reshape(B, chunk, C)
        dw_bound += np.abs(qx_k.T) * ix @ dz_err + product_bound(qx_k.T, qdz, ix * idz)
    dw_bound += (T // chunk) * U32 * np.abs(dw_ref)  # the float32 sum over chunks
    assert (np.abs(np.asarray(dx, np.float64) - dx_ref.reshape(B, T, C)) <= dx_bound.reshape(B, T, C)).all()
    assert (np.abs(np.asarray(dw, np.float64) - dw_ref) <= dw_bound).all()
