"""setup_optimizer: groups, scaling rules and schedules against hand-computed values and float64
references written here from nanochat's nanochat/muon.py, adamw.py and scripts/base_train.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from jaxchat.model.gpt import GPT, GPTConfig, abstract_model
from jaxchat.optim.recipes import (
    describe_param_groups,
    group_learning_rates,
    ParamLayout,
    lr_multiplier,
    muon_momentum,
    scaled_weight_decay,
    setup_optimizer,
    weight_decay_at,
)
from nanochat_numpy import BF16_MIN_COSINE, BF16_REL_TOL, cosine, ref_lr_multiplier, ref_muon_step, ref_second_moment, rel_err, torch_matrices

TINY = GPTConfig(sequence_len=32, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)


def tiny_params(seed=0):
    return nnx.state(GPT(TINY, rngs=nnx.Rngs(seed)), nnx.Param)


def names(params):
    """'blocks/0/attn/c_q/kernel' per leaf, in leaf order (independent of jaxchat.optim.recipes's path helper)."""
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        out.append("/".join(k for k in keys if k != "value"))
    return out


# ---- schedules at their boundaries -----------------------------------------------------------------
def test_lr_multiplier_boundaries():
    # N = 1000, warmup round(0.05 N) = 50, warmdown round(0.4 N) = 400, final 0.1
    lrm = lambda step: float(lr_multiplier(step, 1000, 50, 0.4, 0.1))
    assert lrm(0) == pytest.approx(1 / 50)
    assert lrm(49) == pytest.approx(1.0)  # last warmup step: (49+1)/50
    assert lrm(50) == pytest.approx(1.0)
    assert lrm(600) == pytest.approx(1.0)  # warmdown starts after N - 400
    assert lrm(601) == pytest.approx(399 / 400 + (1 / 400) * 0.1)
    assert lrm(999) == pytest.approx(1 / 400 + (399 / 400) * 0.1)  # last step
    assert lrm(1000) == pytest.approx(0.1)
    # no warmup: 1.0 from step 0; round() is Python's (half to even): round(0.025 * 100) = 2
    assert float(lr_multiplier(0, 100, 0, 0.025, 0.0)) == 1.0
    assert float(lr_multiplier(98, 100, 0, 0.025, 0.0)) == 1.0
    assert float(lr_multiplier(99, 100, 0, 0.025, 0.0)) == pytest.approx(0.5)
    # no warmdown: 1.0 to the end
    assert float(lr_multiplier(100, 100, 0, 0.0, 0.0)) == 1.0


def test_muon_momentum_and_weight_decay_boundaries():
    assert float(muon_momentum(0)) == pytest.approx(0.85)
    assert float(muon_momentum(150)) == pytest.approx(0.90)
    assert float(muon_momentum(300)) == pytest.approx(0.95)
    assert float(muon_momentum(5000)) == pytest.approx(0.95)
    assert float(weight_decay_at(0, 0.072, 1000)) == pytest.approx(0.072)
    assert float(weight_decay_at(500, 0.072, 1000)) == pytest.approx(0.036)
    assert float(weight_decay_at(999, 0.072, 1000)) == pytest.approx(0.072 / 1000)
    assert float(weight_decay_at(1000, 0.072, 1000)) == 0.0


def test_schedules_trace():
    steps = jnp.arange(0, 1001, 37)
    traced = jax.jit(jax.vmap(lambda s: lr_multiplier(s, 1000, 50, 0.4, 0.1)))(steps)
    eager = [float(lr_multiplier(int(s), 1000, 50, 0.4, 0.1)) for s in steps]
    np.testing.assert_allclose(np.asarray(traced), eager, rtol=1e-6)


def test_scaling_rules():
    # d20: model_dim 1280 at the reference batch of 2^19 tokens
    lrs = group_learning_rates(model_dim=1280, total_batch_size=2**19, unembedding_lr=0.004,
                               embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5)
    assert lrs["muon"] == pytest.approx(0.02)
    assert lrs["wte"] == pytest.approx(0.3 * math.sqrt(768 / 1280))
    assert lrs["lm_head"] == pytest.approx(0.004 * math.sqrt(768 / 1280))
    assert lrs["resid_lambdas"] == pytest.approx(0.005)
    assert lrs["x0_lambdas"] == pytest.approx(0.5)
    # a quarter of the batch halves every learning rate
    quarter = group_learning_rates(model_dim=1280, total_batch_size=2**17, unembedding_lr=0.004,
                                   embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5)
    for name in lrs.keys() - {"smear"}:
        assert quarter[name] == pytest.approx(lrs[name] / 2)
    # the 92d63d4 groups: value embeddings at half wte's rate; smear/backout at nanochat's fixed 0.2, unscaled
    assert lrs["value_embeds"] == pytest.approx(lrs["wte"] / 2)
    assert lrs["smear"] == quarter["smear"] == 0.2
    assert scaled_weight_decay(0.2, 12) == pytest.approx(0.2)
    assert scaled_weight_decay(0.2, 20) == pytest.approx(0.072)


# ---- parameter groups ----------------------------------------------------------------------------
def test_every_parameter_of_the_gpt_gets_its_group():
    params = tiny_params()
    labels = dict(zip(names(params), ParamLayout(params).labels))
    assert labels.pop("wte/embedding") == "wte"
    assert labels.pop("lm_head/kernel") == "lm_head"
    assert labels.pop("resid_lambdas") == "resid_lambdas"
    assert labels.pop("x0_lambdas") == "x0_lambdas"
    assert len(labels) == 6 * TINY.n_layer and set(labels.values()) == {"muon"}
    lines = describe_param_groups(group_learning_rates(model_dim=64, total_batch_size=2**19, unembedding_lr=0.004,
                                                       embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5), ParamLayout(params))
    assert "12 tensors" in lines[0] and "8x64x64, 2x64x256, 2x256x64" in lines[0]
    # on 8 devices each stack is padded with zero matrices to a multiple of 8
    assert "8x64x64, 8x64x256, 8x256x64" in describe_param_groups(
        group_learning_rates(model_dim=64, total_batch_size=2**19, unembedding_lr=0.004, embedding_lr=0.3,
                             matrix_lr=0.02, scalar_lr=0.5), ParamLayout(params, num_shards=8))[0]


def test_unlabelled_parameter_is_an_error_that_names_it():
    params = {"wte": {"embedding": jnp.zeros((8, 4))}, "extra_embeds": {"0": jnp.zeros((8, 4))}}
    with pytest.raises(ValueError, match="extra_embeds/0"):
        setup_optimizer(params, model_dim=4, depth=1, num_iterations=10, total_batch_size=2**19)
    # a group of the other recipe's model: bdcc030 has no value embeddings
    params = {"wte": {"embedding": jnp.zeros((8, 4))}, "value_embeds": {"0": jnp.zeros((8, 4))}}
    with pytest.raises(ValueError, match="recipe bdcc030 has no AdamW group 'value_embeds'"):
        setup_optimizer(params, model_dim=4, depth=1, num_iterations=10, total_batch_size=2**19)
    # a vector inside the blocks is not a matrix for Muon either
    with pytest.raises(ValueError, match="blocks/0/norm/scale"):
        setup_optimizer({"blocks": [{"norm": {"scale": jnp.zeros((4,))}}]}, model_dim=4, depth=1, num_iterations=10,
                        total_batch_size=2**19)


def test_negative_learning_rates_are_refused():
    with pytest.raises(ValueError, match="--matrix-lr must be >= 0"):
        setup_optimizer(tiny_params(), model_dim=64, depth=2, num_iterations=10, total_batch_size=2**19, matrix_lr=-0.02)


# ---- AdamW and Muon groups against float64 references ----------------------------------------------
def ref_adamw_step(p, g, m, v, t, lr, b1, b2, eps=1e-10):
    """torch.optim.AdamW with weight_decay 0; t counts from 1."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
    return p - lr / (1 - b1**t) * m / denom, m, v


def test_groups_match_references_with_their_own_learning_rates():
    N, warmup, warmdown, final = 10, 0.2, 0.4, 0.1
    hyper = dict(model_dim=64, depth=2, num_iterations=N, total_batch_size=2**17, unembedding_lr=0.004,
                 embedding_lr=0.3, matrix_lr=0.02, scalar_lr=0.5, weight_decay=0.2, adam_betas=(0.8, 0.95),
                 warmup_ratio=warmup, warmdown_ratio=warmdown, final_lr_frac=final)
    params = tiny_params()
    tx = setup_optimizer(params, **hyper)
    # hand-computed peak rates: batch scale sqrt(2^17 / 2^19) = 0.5, width scale (64/768)^-0.5 = sqrt(12)
    peak = {"wte/embedding": 0.3 * 0.5 * math.sqrt(12), "lm_head/kernel": 0.004 * 0.5 * math.sqrt(12),
            "resid_lambdas": 0.5 * 0.5 * 0.01, "x0_lambdas": 0.5 * 0.5}
    muon_peak, muon_wd = 0.02 * 0.5, 0.2 * (12 / 2) ** 2

    leaf_names = names(params)
    ref = {}
    for name, p in zip(leaf_names, jax.tree.leaves(params)):
        if name in peak:
            ref[name] = (np.asarray(p, np.float64), np.zeros(p.shape), np.zeros(p.shape))
        else:
            ref[name] = [(w, np.zeros_like(w), ref_second_moment(*w.shape)) for w in torch_matrices(p)]
    params0 = params
    state = tx.init(params)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    for t in range(N):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
        lrm = ref_lr_multiplier(t, N, round(warmup * N), warmdown, final)
        beta = (1 - min(t / 300, 1)) * 0.85 + min(t / 300, 1) * 0.95
        for name, g in zip(leaf_names, jax.tree.leaves(grads)):
            g = np.asarray(g, np.float64)
            if name in peak:
                p, m, v = ref[name]
                ref[name] = ref_adamw_step(p, g, m, v, t + 1, peak[name] * lrm, 0.8, 0.95)
            else:
                ref[name] = [ref_muon_step(w, gm, m, s2, muon_peak * lrm, beta, 0.95, muon_wd * (1 - t / N))
                             for (w, m, s2), gm in zip(ref[name], torch_matrices(g))]

    muon_state = state.inner_states["muon"].inner_state
    momentum = tx.layout.from_view(muon_state.momentum)  # the state lives in the view: back to the parameters
    momenta = dict(zip(leaf_names, jax.tree.leaves(momentum, is_leaf=lambda x: isinstance(x, optax.MaskedNode))))
    for name, p0, p in zip(leaf_names, jax.tree.leaves(params0), jax.tree.leaves(params)):
        if name in peak:
            np.testing.assert_allclose(np.asarray(p, np.float64), ref[name][0], rtol=2e-5, atol=1e-6, err_msg=name)
        else:
            (w0,), (w,) = torch_matrices(p0), torch_matrices(p)
            w_ref, m_ref, _ = ref[name][0]
            # momentum (schedule 0.85 -> 0.95) is exact; the update carries bf16 orthogonalisation noise
            np.testing.assert_allclose(torch_matrices(momenta[name])[0], m_ref, rtol=1e-5, atol=1e-6, err_msg=name)
            assert rel_err(w - w0, w_ref - w0) < BF16_REL_TOL, name
            assert cosine(w - w0, w_ref - w0) > BF16_MIN_COSINE, name


def test_hyperparameters_change_per_step_without_recompiling():
    """A constant gradient makes each Adam step lr_t · sign(g): the scalar groups show the LR schedule."""
    N = 6  # warmup round(0.34 * 6) = 2 steps, warmdown round(0.5 * 6) = 3 steps
    params = tiny_params()
    tx = setup_optimizer(params, model_dim=64, depth=2, num_iterations=N, total_batch_size=2**19,
                         warmup_ratio=0.34, warmdown_ratio=0.5, final_lr_frac=0.0)
    traces = 0

    def counted_update(grads, state, params):
        nonlocal traces
        traces += 1
        return tx.update(grads, state, params)

    update = jax.jit(counted_update)
    grads = jax.tree.map(jnp.ones_like, params)
    state = tx.init(params)
    steps = []
    for _ in range(N):
        updates, state = update(grads, state, params)
        steps.append(-float(updates["x0_lambdas"][0]))
    assert traces == 1
    np.testing.assert_allclose(steps, 0.5 * np.array([1 / 2, 1, 1, 1, 2 / 3, 1 / 3]), rtol=1e-5)
    # the schedules the optimizer reports for logging are the ones it trains with
    np.testing.assert_allclose(tx.schedules_at(np.arange(N))["lrm"], [1 / 2, 1, 1, 1, 2 / 3, 1 / 3], rtol=1e-6)


def test_view_round_trips_and_padding_stays_zero():
    """The optimizer's view (Muon's stacks padded for 8 devices) holds every parameter exactly once, and
    the zero matrices that pad a stack get zero updates."""
    params = tiny_params()
    layout = ParamLayout(params, num_shards=8)
    view = layout.to_view(params)
    assert view["muon"]["64x256"].shape == (8, 64, 256)  # 2 kernels + 6 zero matrices
    for a, b in zip(jax.tree.leaves(layout.from_view(view)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)  # slicing and stacking: no arithmetic
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    tx = setup_optimizer(params, model_dim=64, depth=2, num_iterations=10, total_batch_size=2**19, mesh=mesh)
    grads = layout.to_view(jax.tree.map(lambda p: jnp.full(p.shape, 0.01) + p, params))
    updates, _ = jax.jit(tx.tx.update)(grads, tx.tx.init(view), view)
    assert np.all(np.asarray(updates["muon"]["64x256"][2:]) == 0)


# ---- end to end: a tiny GPT memorises a batch ------------------------------------------------------
def test_tiny_model_memorises_a_fixed_batch():
    graphdef, params = nnx.split(GPT(TINY, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 33)), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # the flags' defaults at the reference batch size (LR scale 1), as for a real run of 100 steps
    tx = setup_optimizer(params, model_dim=TINY.n_embd, depth=TINY.n_layer, num_iterations=100,
                         total_batch_size=2**19)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(inputs, targets))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(100):
        params, opt_state, loss = train_step(params, opt_state)
        losses.append(loss)
    first, last = float(losses[0]), float(losses[-1])
    assert first == pytest.approx(math.log(TINY.vocab_size), rel=0.1)
    assert last < first / 50, (first, last)


def test_polar_express_follows_each_recipes_rule():
    """bdcc030 multiplies in bf16 whatever the compute dtype (nanochat/muon.py there); 92d63d4 in the compute
    dtype (nanochat/optim.py there): float32 in a float32 run. Seen in the Muon transform each builds."""
    from jaxchat.optim import recipes as optim

    params = nnx.state(abstract_model(TINY), nnx.Param)
    seen = []
    real_muon = optim.muon

    def recording_muon(**kwargs):
        seen.append(jnp.dtype(kwargs["polar_dtype"]))
        return real_muon(**kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(optim, "muon", recording_muon)
        for recipe, dtype in (("bdcc030", jnp.float32), ("bdcc030", jnp.bfloat16), ("92d63d4", jnp.float32),
                              ("92d63d4", jnp.bfloat16)):
            setup_optimizer(params, model_dim=TINY.n_embd, depth=TINY.n_layer, num_iterations=4,
                            total_batch_size=2**19, recipe=recipe, compute_dtype=dtype,
                            horizon=optim.Horizon(1e6, 1e6))
    assert seen == [jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)]
