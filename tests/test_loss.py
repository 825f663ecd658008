"""The chunked loss head against a float64 NumPy version of the same maths, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxchat.model.loss import LOGIT_SOFTCAP, loss_sum_over, token_losses, token_scores

B, T, C, V = 2, 12, 16, 40


def np_softcap_ce(x, w, targets):
    """float64: per-token loss, d(sum of loss)/dx, d(sum of loss)/dw, greedy hits; -1 targets ignored."""
    s = LOGIT_SOFTCAP * np.tanh((x @ w) / LOGIT_SOFTCAP)
    m = s.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    valid = targets >= 0
    target_logit = np.take_along_axis(s, np.where(valid, targets, 0)[..., None], -1)[..., 0]
    losses = np.where(valid, lse - target_logit, 0.0)
    dz = np_dlogits(x, w, targets)
    return losses, dz @ w.T, np.einsum("btc,btv->cv", x, dz), s.argmax(-1) == targets


def np_dlogits(x, w, targets):
    """float64 d(sum of loss)/dz, z = x @ w the logits before the soft cap (what the backward multiplies):
    (softmax(s) - onehot(target)) x ds/dz, zero at ignored (-1) targets."""
    s = LOGIT_SOFTCAP * np.tanh((x @ w) / LOGIT_SOFTCAP)
    ds = np.exp(s - s.max(-1, keepdims=True))
    ds /= ds.sum(-1, keepdims=True)
    valid = targets >= 0
    safe = np.where(valid, targets, 0)
    np.put_along_axis(ds, safe[..., None], np.take_along_axis(ds, safe[..., None], -1) - 1, -1)
    return ds * valid[..., None] * (1 - (s / LOGIT_SOFTCAP) ** 2)


def inputs(seed=0, ignore=True):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, T, C))
    w = rng.normal(size=(C, V)) * 2.0  # logits of a few units: the soft cap and its derivative both matter
    targets = rng.integers(0, V, size=(B, T))
    if ignore:
        targets[0, :3] = -1
        targets[1, -2:] = -1
    return x, w, targets


@pytest.mark.parametrize("chunk_len", [1, 4, 5, 128])  # 5 does not divide T: the chunks are 4 positions
def test_losses_and_gradients_match_float64(chunk_len):
    x, w, targets = inputs()
    ref_losses, ref_dx, ref_dw, ref_hits = np_softcap_ce(x, w, targets)
    x32, w32 = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)
    losses = token_losses(x32, w32, jnp.asarray(targets), chunk_len)
    dx, dw = jax.grad(lambda x, w: token_losses(x, w, jnp.asarray(targets), chunk_len).sum(), argnums=(0, 1))(x32, w32)
    # float32 inputs of size ~1-10, sums over C=16 and V=40 terms: relative errors of a few 1e-7;
    # the bound is ~100 ulps of each quantity's scale.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5 * np.abs(ref_losses).max())
    np.testing.assert_allclose(dx, ref_dx, atol=1e-5 * np.abs(ref_dx).max())
    np.testing.assert_allclose(dw, ref_dw, atol=1e-5 * np.abs(ref_dw).max())
    assert np.all(np.asarray(losses)[targets < 0] == 0)
    assert np.all(np.asarray(dx)[targets < 0] == 0)  # an ignored position sends no gradient
    score_losses, hits = token_scores(x32, w32, jnp.asarray(targets), chunk_len)
    np.testing.assert_allclose(score_losses, ref_losses, rtol=1e-5, atol=1e-5 * np.abs(ref_losses).max())
    np.testing.assert_array_equal(hits, ref_hits)


@pytest.mark.parametrize("chunk_len", [4, 5])
@pytest.mark.parametrize("seed", [1.0, 3.0])  # jax.grad's seed, and another cotangent, which scales both gradients
def test_the_training_loss_computes_its_gradients_in_the_forward_pass(chunk_len, seed):
    """loss_sum_over (the mean of a training step: Σ loss / valid targets) against float64, and its gradients
    under any cotangent (the seed scales them)."""
    x, w, targets = inputs()
    ref_losses, ref_dx, ref_dw, _ = np_softcap_ce(x, w, targets)
    count = (targets >= 0).sum()
    x32, w32, t = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(targets)
    mean = lambda x, w: seed * loss_sum_over(x, w, t, count, chunk_len)  # noqa: E731
    loss, (dx, dw) = jax.value_and_grad(mean, argnums=(0, 1))(x32, w32)
    np.testing.assert_allclose(loss, seed * ref_losses.sum() / count, rtol=1e-5)  # ~100 ulps, as above
    np.testing.assert_allclose(dx, seed * ref_dx / count, atol=1e-5 * np.abs(ref_dx / count).max())
    np.testing.assert_allclose(dw, seed * ref_dw / count, atol=1e-5 * np.abs(ref_dw / count).max())


def test_bfloat16_hidden_states_accumulate_in_float32():
    """bf16 x and w (the accelerator path): the logits are exact products of the bf16-rounded inputs
    accumulated in float32, so against float64 on those rounded inputs the error is float32's, not bf16's."""
    x, w, targets = inputs(seed=1, ignore=False)
    xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32).astype(jnp.bfloat16)
    ref_losses, _, ref_dw, _ = np_softcap_ce(np.asarray(xb, np.float64), np.asarray(wb, np.float64), targets)
    losses = token_losses(xb, wb.astype(jnp.float32), jnp.asarray(targets), 4)
    assert losses.dtype == jnp.float32
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5 * np.abs(ref_losses).max())
    dw = jax.grad(lambda w: token_losses(xb, w, jnp.asarray(targets), 4).sum())(wb.astype(jnp.float32))
    assert dw.dtype == jnp.float32
    # The backward matmul takes bf16 operands (as autodiff of a bf16 matmul would): x is exact (bf16 already),
    # dz is float32 (error ~1e-6 absolute: softmax terms <= 1 in float32) rounded to bf16 (relative error at
    # most u = 2^-8), and float32 sums 24 products (at most 24 eps32 relative). Each element of dw is
    # sum_bt x dz, so its error is at most (u + 24 eps32) sum_bt |x| |dz| + 2e-6 sum_bt |x|.
    xf = np.abs(np.asarray(xb, np.float64))
    dz = np.abs(np_dlogits(np.asarray(xb, np.float64), np.asarray(wb, np.float64), targets))
    bound = (2.0**-8 + 24 * 2.0**-24) * np.einsum("btc,btv->cv", xf, dz) + 2e-6 * xf.sum((0, 1))[:, None]
    assert np.all(np.abs(np.asarray(dw, np.float64) - ref_dw) <= bound)
    assert np.abs(np.asarray(dw, np.float64) - ref_dw).max() > 0  # bf16 rounding shows: the bound is not vacuous


def test_no_batch_by_vocab_tensor_is_kept_for_the_backward_pass():
    """What autodiff keeps of the loss head: the inputs and one float32 per token, never (B, T, V) values."""
    x, w, targets = inputs()
    def loss(x, w):
        return token_losses(x, w, jnp.asarray(targets), 4).sum()

    # the VJP closure holds exactly the residuals (a pytree), seen here as shapes
    vjp_fn = jax.eval_shape(lambda x, w: jax.vjp(loss, x, w)[1], jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    shapes = [tuple(r.shape) for r in jax.tree.leaves(vjp_fn)]
    assert (B, T, V) not in shapes and all(np.prod(s) < B * T * V for s in shapes), shapes
