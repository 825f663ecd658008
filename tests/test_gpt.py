"""The GPT against nanochat's architecture (nanochat/gpt.py at the README's commit): counts, an independent
float64 NumPy forward, windows, GQA, KV cache, losses and remat (the state-dict interop: test_export.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from compiled import forward, new_model
from nanochat_numpy import np_forward, randomized
from jaxchat.model.attention import causal_attention
from jaxchat.model.gpt import GPT, CausalSelfAttention, GPTConfig, Linear, abstract_model, use_fp8
from jaxchat.export.nanochat import from_nanochat_state_dict, to_nanochat_state_dict

TINY = GPTConfig(sequence_len=16, vocab_size=100, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, window_pattern="SL")


def np_cross_entropy(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    m = logits.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    out = np.zeros(targets.shape)
    for b, t in np.ndindex(targets.shape):
        if targets[b, t] >= 0:
            out[b, t] = logz[b, t] - logits[b, t, targets[b, t]]
    return out


# ---- counting -------------------------------------------------------------------------------------
def spec_flops(config: GPTConfig, n_params: int) -> int:
    """nanochat's estimate_flops written out: 6 (N - wte - lambdas) + sum_l 12 H D min(window_l, T)."""
    V, C, L = config.padded_vocab_size, config.n_embd, config.n_layer
    windows = [config.sequence_len if config.window_pattern[i % len(config.window_pattern)] == "L"
               else config.sequence_len // 2 for i in range(L)]
    windows[-1] = config.sequence_len
    attn = sum(12 * config.n_head * (C // config.n_head) * min(w, config.sequence_len) for w in windows)
    return 6 * (n_params - V * C - 2 * L) + attn


def test_d20_parameter_count_and_flops():
    config = GPTConfig(sequence_len=2048, vocab_size=65536, n_layer=20, n_head=10, n_kv_head=10, n_embd=1280)
    model = abstract_model(config)  # shapes only: no memory spent
    assert model.num_scaling_params() == 560_988_200
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert params["wte"]["embedding"].shape == (65536, 1280)
    assert params["blocks"][19]["mlp"]["c_fc"]["kernel"].shape == (1280, 5120)
    assert model.estimate_flops() == spec_flops(config, 560_988_200)


def test_windowed_small_config_flops():
    config = GPTConfig(sequence_len=64, vocab_size=1000, n_layer=5, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SSL")
    model = abstract_model(config)
    n = model.num_scaling_params()
    C, V, kv = 64, 1024, 1 * 32  # vocabulary padded to a multiple of 64; one key/value head of 32
    assert n == 2 * V * C + 5 * (C * C + 2 * C * kv + C * C + 8 * C * C) + 2 * 5
    assert model.estimate_flops() == spec_flops(config, n)
    assert config.window_sizes() == (32, 32, 64, 32, 64)


def test_each_abstract_model_is_its_own():
    """abstract_model keeps its trace of the constructor per process: what one caller changes on its model (fp8
    switched on, as build_run does) is not in the next caller's, nor are its Variables the next one's."""
    config = GPTConfig(sequence_len=64, vocab_size=512, n_layer=2, n_head=1, n_kv_head=1, n_embd=128)
    first = abstract_model(config)
    assert use_fp8(first)[0] > 0
    second = abstract_model(config)
    assert not any(node.fp8_enabled for _, node in nnx.iter_graph(second) if isinstance(node, Linear))
    assert second.wte.embedding is not first.wte.embedding
    assert nnx.state(second) == nnx.state(first)  # the same shapes and dtypes


def test_vocab_padding_and_init_table():
    config = GPTConfig(sequence_len=8, vocab_size=1000, n_layer=2, n_head=2, n_kv_head=2, n_embd=256)
    assert config.padded_vocab_size == 1024
    sd = to_nanochat_state_dict(new_model(config))
    assert sd["transformer.wte.weight"].shape == (1024, 256)
    assert abs(sd["transformer.wte.weight"].std() - 1.0) < 0.01
    assert abs(sd["lm_head.weight"].std() - 0.001) < 1e-4
    bound = math.sqrt(3) / math.sqrt(256)
    for name in ("attn.c_q", "attn.c_k", "attn.c_v", "mlp.c_fc"):
        w = sd[f"transformer.h.0.{name}.weight"]
        assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
        assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound
    for name in ("attn.c_proj", "mlp.c_proj"):
        assert not sd[f"transformer.h.1.{name}.weight"].any()
    np.testing.assert_array_equal(sd["resid_lambdas"], np.ones(2))
    np.testing.assert_array_equal(sd["x0_lambdas"], np.zeros(2))


# ---- the forward ----------------------------------------------------------------------------------
def test_logits_match_float64_numpy_reference():
    model = randomized(TINY)
    idx = np.random.default_rng(0).integers(0, TINY.vocab_size, size=(2, TINY.sequence_len))
    logits = np.asarray(forward(model, jnp.asarray(idx)))
    assert logits.shape == (2, TINY.sequence_len, TINY.vocab_size) and logits.dtype == np.float32
    ref = np_forward(to_nanochat_state_dict(model), TINY, idx)
    rel = np.linalg.norm(logits - ref) / np.linalg.norm(ref)
    assert rel < 1e-5, rel


def test_loss_ignores_minus_one_and_none_reduction():
    model = randomized(TINY, seed=3)
    rng = np.random.default_rng(1)
    idx = rng.integers(0, TINY.vocab_size, size=(2, 12))
    targets = rng.integers(0, TINY.vocab_size, size=(2, 12))
    targets[0, :5] = -1
    targets[1, 7] = -1
    ref = np_cross_entropy(np_forward(to_nanochat_state_dict(model), TINY, idx), targets)
    per_token = np.asarray(forward(model, jnp.asarray(idx), jnp.asarray(targets), loss_reduction="none"))
    assert per_token.shape == (2, 12)
    np.testing.assert_allclose(per_token, ref, rtol=1e-5, atol=1e-5)
    assert (per_token[targets < 0] == 0).all()
    mean = float(forward(model, jnp.asarray(idx), jnp.asarray(targets)))
    np.testing.assert_allclose(mean, ref[targets >= 0].mean(), rtol=1e-5)


# ---- attention windows and GQA ---------------------------------------------------------------------
def test_window_semantics_in_attention():
    T, w = 16, 4
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, T, 2, 8)), jnp.float32) for _ in range(3))
    attention = jax.jit(causal_attention, static_argnames="window")
    base = attention(q, k, v, window=w)
    i = 12
    far = i - w - 1  # outside the window: no effect on position i
    near = i - w  # the oldest key inside the window
    for pos, should_change in ((far, False), (near, True), (i, True)):
        k2, v2 = k.at[:, pos].add(1.0), v.at[:, pos].add(1.0)
        out = attention(q, k2, v2, window=w)
        changed = not np.allclose(out[:, i], base[:, i], atol=1e-6)
        assert changed == should_change, (pos, changed)
        assert np.allclose(out[:, :pos], base[:, :pos], atol=1e-6)  # causality


@pytest.mark.parametrize("window", [0, 1, 100, 127, 128, 200, 299])
def test_blocked_attention_against_float64(window):
    """The 'xla' path in query blocks (jaxchat.model.attention.blocked_attention): T = 300 is three blocks of 128,
    128 and 44 rows, windows inside a block, across blocks and the whole context, GQA (4 query heads on 2
    key heads). Forward against float64 NumPy; gradients against the unblocked masked attention of
    jax.nn.dot_product_attention (the same maths in one piece), both within float32 rounding of values ~1."""
    from jaxchat.model.attention import blocked_attention, query_block_len

    T, H, Hkv, D = 300, 4, 2, 8
    assert query_block_len(T) == 128
    rng = np.random.default_rng(window)
    q, k, v = (rng.normal(size=(2, T, h, D)) for h in (H, Hkv, Hkv))
    delta = np.arange(T)[:, None] - np.arange(T)[None, :]
    mask = (delta >= 0) & (delta <= window)
    kk, vv = np.repeat(k, H // Hkv, axis=2), np.repeat(v, H // Hkv, axis=2)
    scores = np.where(mask[None, None], np.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(D), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    ref = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vv)
    q32, k32, v32 = (jnp.asarray(a, jnp.float32) for a in (q, k, v))
    out, vjp = jax.vjp(jax.jit(lambda q, k, v: blocked_attention(q, k, v, window)), q32, k32, v32)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    whole = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask)[None, None])  # noqa: E731
    cotangent = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    for got, want in zip(vjp(cotangent), jax.vjp(jax.jit(whole), q32, k32, v32)[1](cotangent)):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


def test_window_semantics_in_model_layers():
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=16, window_pattern="S")
    assert config.window_sizes() == (8, 16)  # last layer is always full
    model = randomized(config, seed=5)
    attn: CausalSelfAttention = model.blocks[0].attn
    x = jax.random.normal(jax.random.key(0), (1, 16, 16))
    from jaxchat.model.gpt import rotary_cos_sin

    cos, sin = rotary_cos_sin(jnp.arange(16), config.head_dim)
    layer = nnx.jit(lambda attn, x: attn(x, cos, sin))
    base = layer(attn, x)
    out = layer(attn, x.at[:, 15 - 9].add(1.0))
    np.testing.assert_allclose(out[:, 15], base[:, 15], atol=1e-6)  # 9 back: outside window 8
    out = layer(attn, x.at[:, 15 - 8].add(1.0))
    assert not np.allclose(out[:, 15], base[:, 15], atol=1e-6)
    # the whole model sees everything through its last (full) layer
    idx = jnp.arange(16)[None] % 64
    full = forward(model, idx)
    assert not np.allclose(forward(model, idx.at[:, 0].set(63))[:, 15], full[:, 15], atol=1e-6)


def test_gqa_equals_repeated_heads():
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, window_pattern="L")
    gqa = randomized(config, seed=7)
    sd = to_nanochat_state_dict(gqa)
    D, G = config.head_dim, config.n_head // config.n_kv_head
    for i in range(config.n_layer):
        for name in ("c_k", "c_v"):
            key = f"transformer.h.{i}.attn.{name}.weight"  # (Hkv*D, C): repeat each head's D rows G times
            w = sd[key].reshape(config.n_kv_head, D, config.n_embd)
            sd[key] = np.repeat(w, G, axis=0).reshape(config.n_head * D, config.n_embd)
    mha_config = GPTConfig(**{**config.__dict__, "n_kv_head": config.n_head})
    mha = from_nanochat_state_dict(mha_config, sd)
    idx = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 16)))
    np.testing.assert_allclose(forward(gqa, idx), forward(mha, idx), rtol=1e-5, atol=1e-5)


# ---- KV cache -------------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len", [3, 11])
def test_kv_cache_decode_equals_full_forward(prompt_len):
    # window 8 (S) on the first layers: decoding past position 8 exercises the window; past 16 the L layer too
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=16, window_pattern="SSL")
    model = randomized(config, seed=11)
    total = 24
    idx = jnp.asarray(np.random.default_rng(2).integers(0, 64, size=(2, total)))
    full = forward(model, idx)  # (2, total, V): the reference, one forward over the whole sequence
    cache = model.init_cache(batch_size=2, max_len=32)
    decode = nnx.jit(lambda m, x, c: m.decode(x, c))
    logits, cache = decode(model, idx[:, :prompt_len], cache)
    np.testing.assert_allclose(logits, full[:, :prompt_len], rtol=1e-4, atol=1e-4)
    for t in range(prompt_len, total):
        logits, cache = decode(model, idx[:, t : t + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, t], rtol=1e-4, atol=1e-4)
    assert int(cache.pos) == total


def test_cache_longer_than_rotary_range_is_refused():
    model = abstract_model(TINY)  # refused before any array is made
    with pytest.raises(ValueError, match="rotary"):
        model.init_cache(1, 10 * TINY.sequence_len + 1)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="n_kv_head"):
        GPTConfig(n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="window_pattern"):
        GPTConfig(window_pattern="SXL")


# ---- activation checkpointing ----------------------------------------------------------------------
def test_remat_policies_give_the_same_gradients_and_keep_less():
    """Each policy recomputes what it does not keep: the same maths, so the same gradients (to float32
    rounding of the recomputation order), and 'block' keeps fewer bytes than 'dots' than 'none'."""
    reference = randomized(TINY, seed=5)
    params = nnx.state(reference, nnx.Param)
    rng = np.random.default_rng(2)
    idx = jnp.asarray(rng.integers(0, TINY.vocab_size, size=(2, TINY.sequence_len)))
    targets = jnp.asarray(rng.integers(0, TINY.vocab_size, size=(2, TINY.sequence_len)))
    grads, kept = {}, {}
    for policy in ("none", "dots", "block"):
        graphdef, _ = nnx.split(abstract_model(TINY, dtype=jnp.float32, remat=policy))

        def loss(p):
            return nnx.merge(graphdef, p)(idx, targets)

        grads[policy] = jax.tree.leaves(jax.jit(jax.grad(loss))(params))
        vjp_fn = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)  # its leaves are the saved residuals
        kept[policy] = sum(math.prod(r.shape) * r.dtype.itemsize for r in jax.tree.leaves(vjp_fn))
    for policy in ("dots", "block"):
        for a, b in zip(grads[policy], grads["none"]):
            np.testing.assert_allclose(a, b, atol=1e-5 * max(np.abs(b).max(), 1e-3))
    assert kept["block"] < kept["dots"] < kept["none"], kept
    with pytest.raises(ValueError, match="remat policy"):
        GPT(TINY, rngs=nnx.Rngs(0), remat="most")
