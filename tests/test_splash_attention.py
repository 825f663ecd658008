"""Splash attention (jaxchat/model/splash_attention.py), the TPU path, run here in Pallas' interpret mode: against a
float64 NumPy attention with the same windows (forward and gradients, GQA, windows shorter and longer than a
tile), a whole d2 train step against the XLA path's, and which kernel each platform picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import nnx
from nanochat_numpy import randomized

from jaxchat.model.attention import causal_attention, default_implementation
from jaxchat.model.gpt import GPT, GPTConfig
from jaxchat.distributed.mesh import batch_sharding, make_mesh, put_batch
from jaxchat.train.run import RunSettings, build_run
from jaxchat.model.splash_attention import SPLASH_BLOCK, block_len

T, H, HKV, D = 1024, 4, 2, 32  # two tiles of 512; GQA, two query heads per key/value head


def np_attention(q, k, v, window):
    """Float64 causal sliding-window attention (query i sees key j iff 0 <= i - j <= window) and its VJP."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # query head h reads key head h // group
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    delta = np.arange(q.shape[1])[:, None] - np.arange(q.shape[1])[None]
    s = np.where((delta >= 0) & (delta <= window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = np.einsum("bhts,bshd->bthd", p, v)

    def vjp(g):
        g = np.asarray(g, np.float64)
        dv = np.einsum("bhts,bthd->bshd", p, g)
        dp = np.einsum("bthd,bshd->bhts", g, v)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
        dq, dk = np.einsum("bhts,bshd->bthd", ds, k), np.einsum("bhts,bthd->bshd", ds, q)
        fold = lambda a: a.reshape(*a.shape[:2], -1, group, a.shape[-1]).sum(3)  # noqa: E731  (sum a group's heads)
        return dq, fold(dk), fold(dv)

    return y, vjp


@pytest.mark.parametrize("window", [100, 700, T], ids=["shorter_than_a_tile", "longer_than_a_tile", "full"])
def test_splash_against_float64(window):
    """float32 inputs of magnitude ~1: each output is an average of values ~1 over up to 1024 keys, so a float32
    computation in any order is within ~1e-6 (measured ~1e-6 for the output); the gradients pass through the
    softmax's derivative, sums of a thousand products: 2e-5 absolute holds them with room, and a wrong mask moves
    them by more than 0.1."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(shape).astype(np.float32)
                  for shape in [(1, T, H, D), (1, T, HKV, D), (1, T, HKV, D), (1, T, H, D)])
    attention = jax.jit(lambda q, k, v: causal_attention(q, k, v, window, "splash"))
    y, vjp = jax.vjp(attention, q, k, v)
    expected, expected_vjp = np_attention(q, k, v, window)
    np.testing.assert_allclose(np.asarray(y), expected, rtol=0, atol=5e-6)
    for got, want in zip(vjp(jnp.asarray(g)), expected_vjp(g)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-5)


def test_tiles_cover_the_sequence():
    assert [block_len(n) for n in (2048, 1024, 640, 384, 128)] == [SPLASH_BLOCK, SPLASH_BLOCK, 128, 384, 128]
    with pytest.raises(ValueError, match="a multiple of 128, got 1000"):
        block_len(1000)


def test_each_platform_picks_its_kernel():
    assert default_implementation("tpu", "PJRT C API\nTFRT TPU v6 lite") == "splash"
    assert default_implementation("gpu", "cuda 12080") == "cudnn"
    assert default_implementation("gpu", "rocm 60200") == "xla"  # ROCm's backend is 'gpu' too: no cuDNN there
    assert default_implementation("cpu", "cpu") == "xla"


D2 = dict(sequence_len=128, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=128, window_pattern="SL")


def d2_loss(attention: str) -> float:
    """One d2 train step (windows 64 and 128 of 128 positions) with that attention, from the same weights and
    batch: the loss it reports."""
    settings = RunSettings(depth=2, max_seq_len=128, device_batch_size=2, total_batch_size=256, num_iterations=4,
                           seed=3, remat="dots", attention=attention)
    run = build_run(settings, 256, mesh=make_mesh(1))
    state = run.init_state()
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: (x + 0.05 * rng.standard_normal(x.shape)).astype(x.dtype), jax.device_get(state.params))
    spec = batch_sharding(make_mesh(1))
    batch = [put_batch(rng.integers(0, 256, size=(1, 2, 128)).astype(np.int32), spec) for _ in range(2)]
    _, _, metrics = run.train_step()(jax.device_put(params, run.state.param_shardings), state.opt_state, *batch)
    return float(metrics["loss"])


def model_of(attention: str, remat: str) -> GPT:
    model = GPT(GPTConfig(**D2), rngs=nnx.Rngs(0), attention_implementation=attention, remat=remat, dtype=jnp.float32)
    nnx.update(model, nnx.state(randomized(GPTConfig(**D2), seed=2), nnx.Param))  # every weight non-zero
    return model


def gradients(model: GPT, idx: jax.Array):
    graphdef, state = nnx.split(model)
    return jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(idx, jnp.roll(idx, -1, 1))))(state)


def test_a_d2_step_with_splash_equals_the_xla_paths():
    """The train step's loss within float32 rounding (1e-6 relative); the gradients of the same model's loss
    within 2e-6 of each leaf's largest (float32 sums in another order; measured 6.7e-7). The updated weights are
    not compared: Muon's first step orthogonalises and NorMuon normalises per row, so gradient differences of
    1e-7 moved some weights by 1e-3 of the update, in either path's own float32 noise."""
    assert d2_loss("splash") == pytest.approx(d2_loss("xla"), rel=1e-6)
    idx = jnp.asarray(np.random.default_rng(1).integers(0, 256, (2, 128)), jnp.int32)
    grads = {a: gradients(model_of(a, "dots"), idx) for a in ("splash", "xla")}
    for got, want in zip(jax.tree.leaves(grads["splash"]), jax.tree.leaves(grads["xla"])):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * float(np.abs(want).max()))


def test_remat_dots_keeps_the_forward_kernels_results():
    """The backward reads the forward kernel's output and logsumexp: with --remat dots they are kept, so the
    forward kernel runs once per layer, as without remat; 'block' runs it again in the backward."""
    idx = jnp.zeros((1, 128), jnp.int32)

    def forward_kernels(remat: str) -> int:
        graphdef, state = nnx.split(model_of("splash", remat))
        jaxpr = jax.make_jaxpr(jax.grad(lambda s: nnx.merge(graphdef, s)(idx, idx)))(state)
        return str(jaxpr).count("name=splash_mqa_fwd")

    assert forward_kernels("none") == forward_kernels("dots") == 2
    assert forward_kernels("block") == 4
