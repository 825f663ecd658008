"""The optimizer of recipe 92d63d4 against a float64 NumPy version of nanochat's maths at that commit
(nanochat/optim.py: adamw_step_fused, muon_step_fused; scripts/base_train.py: the schedules, the batch-size
rule and the scaling rules), written here in PyTorch's (rows, cols) = (out, in) layout.

Tolerances. Muon with float32 Polar Express follows the float64 polynomial to ~1e-5 (tests/test_muon.py),
so its parameter change must match to 1e-4 (relative Frobenius). In bf16, jaxchat's error against float64
must be no larger than nanochat's own bf16 rounding (emulated below: bf16 matmul operands, every op's
result rounded to bf16 up to the end of Polar Express, float32 after it as 92d63d4 casts back to the
parameters' float32). AdamW is float32 arithmetic: see adamw_tolerance.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nanochat_numpy import POLAR_EXPRESS_COEFFS, bf16_round, exact, ref_lr_multiplier, rel_err, torch_matrices
from jaxchat.optim.muon import muon
from jaxchat.optim.recipes import (
    Horizon,
    auto_total_batch_size,
    lr_multiplier,
    muon_momentum_92d63d4,
    scaled_weight_decay_92d63d4,
    setup_optimizer,
    weight_decay_cosine,
)
from jaxchat.train.settings import RunSettings, SettingsError, parse_settings

MUON_OPTIONS = dict(beta2=0.9, norm_safety=1.01, row_equilibration=True, renormalize=True)
F32_EPS = 2.0**-23


# ---- nanochat 92d63d4's maths, float64 -----------------------------------------------------------
def ref_polar_express_92d63d4(u: np.ndarray, rnd=exact) -> np.ndarray:
    """X = u.bfloat16(); MuonEq: rows rescaled to ‖X‖_F/√rows; X/(1.01‖X‖_F + 1e-6); five Polar Express
    steps."""
    rows = u.shape[0]
    x = rnd(u)
    target = np.linalg.norm(x) / math.sqrt(rows)
    row_norm = np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-6)
    x = rnd(x * rnd(target / row_norm))
    x = rnd(x / rnd(rnd(rnd(np.linalg.norm(x)) * 1.01) + 1e-6))
    transposed = x.shape[0] > x.shape[1]  # a tall matrix: A = XᵀX, X <- aX + XB, i.e. the wide rule on Xᵀ
    x = x.T if transposed else x
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = rnd(x @ x.T)
        B = rnd(rnd(b * A) + rnd(c * rnd(A @ A)))
        x = rnd(rnd(a * x) + rnd(B @ x))
    return x.T if transposed else x


def ref_muon_step_92d63d4(w, g, m, s2, lr, beta, wd, rnd=exact):
    """One muon_step_fused on a PyTorch-layout matrix w (rows, cols) -> (w, m, s2), beta2 0.9."""
    rows, cols = w.shape
    m = m + (1 - beta) * (g - m)  # momentum_buffer.lerp_(g, 1 - beta)
    u = g + beta * (m - g)  # g.lerp_(momentum_buffer, beta)
    x = ref_polar_express_92d63d4(u, rnd)
    x = x * (math.sqrt(min(rows, cols)) / max(np.linalg.norm(x), 1e-6))  # Muon+
    axis = 1 if rows >= cols else 0
    n = x.shape[axis]
    v = np.mean(x**2, axis=axis, keepdims=True)
    norm = np.sqrt(v.sum() * n)
    s2 = s2 + (1 - 0.9) * (v - s2)
    step = 1 / np.sqrt(np.maximum(s2, 1e-10))
    norm_new = np.sqrt((v * n * step**2).sum())
    x = x * step * (norm / max(norm_new, 1e-10))
    lr_eff = lr * max(1.0, rows / cols) ** 0.5
    mask = x * w >= 0
    return w - (lr_eff * x + lr_eff * wd * w * mask), m, s2


def ref_adamw_step_92d63d4(p, g, m, v, t, lr, b1, b2, wd, eps=1e-10):
    """adamw_step_fused: p·(1 − lr·wd), moments by lerp, bias-corrected step; t counts from 1."""
    p = p * (1 - lr * wd)
    m = m + (1 - b1) * (g - m)
    v = v + (1 - b2) * (g * g - v)
    denom = np.sqrt(v / (1 - b2**t)) + eps
    return p - lr / (1 - b1**t) * m / denom, m, v


def ref_momentum(it, n, warmdown_ratio):
    warmdown = round(warmdown_ratio * n)
    start = n - warmdown
    if it < 400:
        return (1 - it / 400) * 0.85 + it / 400 * 0.97
    if it >= start:
        progress = (it - start) / warmdown
        return 0.97 * (1 - progress) + 0.90 * progress
    return 0.97


def ref_weight_decay(it, wd, n):
    return wd * 0.5 * (1 + math.cos(math.pi * it / n))


def ref_scaling_params(depth, vocab=32768, aspect=64, head_dim=128):
    """92d63d4's scaling count (transformer matrices + lm_head) of its GPT at this depth: width rounded up
    to a multiple of head_dim; per layer c_q, c_k, c_v, c_proj (C² each, as many kv heads as heads),
    c_fc and the MLP's c_proj (4C² each); ve_gate (12 x kv heads) on layers i with i % 2 == (L-1) % 2."""
    c = -(-depth * aspect // head_dim) * head_dim
    heads = c // head_dim
    ve_layers = sum(1 for i in range(depth) if i % 2 == (depth - 1) % 2)
    return depth * 12 * c * c + ve_layers * 12 * heads + vocab * c


# ---- Muon ------------------------------------------------------------------------------------------
KERNELS = {"tall": (16, 48), "wide": (48, 16), "square": (32, 32), "layers": (2, 24, 40)}  # (in, out)


def run_muon(polar_dtype, steps, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: (0.1 * rng.standard_normal(s)).astype(np.float32) for k, s in KERNELS.items()}
    lr = lambda t: 0.02 * (1 - 0.15 * t)  # noqa: E731
    beta = lambda t: 0.85 + 0.03 * t  # noqa: E731
    wd = lambda t: 0.3 * (1 - 0.1 * t)  # noqa: E731
    tx = muon(learning_rate=lr, momentum=beta, weight_decay=wd, polar_dtype=polar_dtype, **MUON_OPTIONS)
    state, new = tx.init(params), params
    refs = {rnd: {k: [(w, np.zeros_like(w), np.zeros((w.shape[0], 1) if w.shape[0] >= w.shape[1] else (1, w.shape[1])))
                      for w in torch_matrices(p)] for k, p in params.items()} for rnd in (exact, bf16_round)}
    update = jax.jit(tx.update)
    for t in range(steps):
        grads = {k: rng.standard_normal(s).astype(np.float32) for k, s in KERNELS.items()}
        updates, state = update(grads, state, new)
        new = optax.apply_updates(new, updates)
        for rnd, ref in refs.items():
            for k in KERNELS:
                ref[k] = [ref_muon_step_92d63d4(w, g, m, s2, lr(t), beta(t), wd(t), rnd)
                          for (w, m, s2), g in zip(ref[k], torch_matrices(grads[k]))]
    return params, new, refs


@pytest.mark.parametrize("steps", [1, 5])
def test_muon_float32_polar_express_matches_the_float64_maths(steps):
    params, new, refs = run_muon(jnp.float32, steps)
    for k in KERNELS:
        for w0, w, (w_ref, _, _) in zip(torch_matrices(params[k]), torch_matrices(new[k]), refs[exact][k]):
            assert rel_err(w - w0, w_ref - w0) < 1e-4, (k, rel_err(w - w0, w_ref - w0))


@pytest.mark.parametrize("steps", [1, 3])
def test_muon_bf16_is_no_less_accurate_than_nanochats_own(steps):
    params, new, refs = run_muon(jnp.bfloat16, steps)
    for k in KERNELS:
        for w0, w, (w_ref, _, _), (w_nano, _, _) in zip(torch_matrices(params[k]), torch_matrices(new[k]),
                                                        refs[exact][k], refs[bf16_round][k]):
            ours, theirs = rel_err(w - w0, w_ref - w0), rel_err(w_nano - w0, w_ref - w0)
            # theirs > 1e-3: the emulation rounds (else the comparison would prove nothing)
            assert theirs > 1e-3 and ours <= theirs, (k, ours, theirs)


def test_bdcc030_muon_is_not_the_92d63d4_one():
    """The options change the update (so the tests above can tell the two apart)."""
    rng = np.random.default_rng(1)
    p = {"w": (0.1 * rng.standard_normal((16, 48))).astype(np.float32)}
    g = {"w": rng.standard_normal((16, 48)).astype(np.float32)}
    old, new = (muon(0.02, polar_dtype=jnp.float32, **opts) for opts in ({}, MUON_OPTIONS))
    u_old, u_new = old.update(g, old.init(p), p)[0]["w"], new.update(g, new.init(p), p)[0]["w"]
    assert rel_err(np.asarray(u_new, np.float64), np.asarray(u_old, np.float64)) > 1e-3


# ---- the whole optimizer: every group ---------------------------------------------------------------
C, V, L, KV = 32, 64, 2, 64  # width, vocab, layers, value-embedding width (n_kv_head x head_dim)


def params_92d63d4(rng):
    """The parameter tree of a 92d63d4 GPT (jaxchat's names), small, O(0.1)-random."""
    r = lambda *s: jnp.asarray(0.1 * rng.standard_normal(s), jnp.float32)  # noqa: E731
    block = lambda: {"attn": {"c_q": {"kernel": r(C, C)}, "ve_gate": {"kernel": r(12, 2)}},  # noqa: E731
                     "mlp": {"c_fc": {"kernel": r(C, 4 * C)}}}
    return {"blocks": [block() for _ in range(L)], "wte": {"embedding": r(V, C)}, "lm_head": {"kernel": r(C, V)},
            "value_embeds": {"1": {"embedding": r(V, KV)}}, "resid_lambdas": r(L), "x0_lambdas": r(L),
            "smear_gate": {"kernel": r(24, 1)}, "smear_lambda": r(1), "backout_lambda": r(1)}


# group -> (peak lr, betas, weight decay), from GPT.setup_optimizer at 92d63d4 and base_train.py's scaling
# at batch 2^17: batch scale √(2^17/2^19) = 0.5, width scale (32/768)^-0.5 = √24
ADAMW = {
    "lm_head/kernel": (0.008 * 0.5 * math.sqrt(24), (0.8, 0.96), 0.01),
    "wte/embedding": (0.3 * 0.5 * math.sqrt(24), (0.8, 0.995), 0.001),
    "value_embeds/1/embedding": (0.3 * 0.5 * math.sqrt(24) * 0.5, (0.8, 0.995), 0.01),
    "resid_lambdas": (0.5 * 0.5 * 0.01, (0.8, 0.95), 0.05),
    "x0_lambdas": (0.5 * 0.5, (0.96, 0.95), 0.0),
    "smear_gate/kernel": (0.2, (0.8, 0.95), 0.0),
    "smear_lambda": (0.2, (0.8, 0.95), 0.0),
    "backout_lambda": (0.2, (0.8, 0.95), 0.0),
}


def leaf_names(tree):
    return ["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("compute_dtype", [jnp.float32, jnp.bfloat16])
def test_every_group_matches_the_float64_maths_over_five_steps(compute_dtype):
    """Polar Express follows the model's compute dtype at 92d63d4: float32 in a float32 run (as nanochat's
    `X = g.bfloat16() if COMPUTE_DTYPE == torch.bfloat16 else g`), bf16 in a bf16 one."""
    N, warmup, warmdown, final = 12, 3, 0.5, 0.05
    target, reference = 3_000_000, 1_000_000.0
    wd = 0.28 * math.sqrt(2**17 / 2**19) * reference / target
    rng = np.random.default_rng(0)
    params = params_92d63d4(rng)
    opt = setup_optimizer(params, model_dim=C, depth=L, num_iterations=N, total_batch_size=2**17,
                          unembedding_lr=0.008, weight_decay=0.28, warmup_steps=warmup, warmdown_ratio=warmdown,
                          final_lr_frac=final, recipe="92d63d4", horizon=Horizon(target, reference),
                          compute_dtype=compute_dtype)
    names = leaf_names(params)
    ref, nanochat = {}, {}  # float64; Muon also with nanochat's bf16 rounding, the yardstick
    for name, p in zip(names, jax.tree.leaves(params)):
        w = np.asarray(p, np.float64)
        ref[name] = ((w, np.zeros(w.shape), np.zeros(w.shape)) if name in ADAMW else
                     [(m, np.zeros_like(m), np.zeros((m.shape[0], 1) if m.shape[0] >= m.shape[1] else (1, m.shape[1])))
                      for m in torch_matrices(p)])
        nanochat[name] = ref[name]
    state, new = opt.init(params), params
    update = jax.jit(opt.update)
    for t in range(5):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), jnp.float32), params)
        updates, state = update(grads, state, new)
        new = optax.apply_updates(new, updates)
        lrm = ref_lr_multiplier(t, N, warmup, warmdown, final)
        for name, g in zip(names, jax.tree.leaves(grads)):
            if name in ADAMW:
                peak, (b1, b2), decay = ADAMW[name]
                p_ref, m, v = ref[name]
                ref[name] = ref_adamw_step_92d63d4(p_ref, np.asarray(g, np.float64), m, v, t + 1, peak * lrm, b1, b2,
                                                   decay)
            else:
                hyper = (0.02 * 0.5 * lrm, ref_momentum(t, N, warmdown), ref_weight_decay(t, wd, N))
                ref[name] = [ref_muon_step_92d63d4(w, gm, m, s2, *hyper)
                             for (w, m, s2), gm in zip(ref[name], torch_matrices(g))]
                nanochat[name] = [ref_muon_step_92d63d4(w, gm, m, s2, *hyper, rnd=bf16_round)
                                  for (w, m, s2), gm in zip(nanochat[name], torch_matrices(g))]
    for name, p0, p in zip(names, jax.tree.leaves(params), jax.tree.leaves(new)):
        if name in ADAMW:
            # float32, per step: p rounds at 2^-24·|p|; the step lr·m̂/(√v̂ + ε) has |m̂/√v̂| <= √t <= √5
            # (Cauchy-Schwarz over the bias-corrected moments) and ~6 float32 ops of <= 1/2 ulp each, plus
            # lr and the multiplier in float32: < 10·2^-23·lr. Five steps of both.
            p_ref = ref[name][0]
            tolerance = 5 * (F32_EPS / 2 * np.abs(p_ref) + 10 * F32_EPS * ADAMW[name][0])
            assert np.all(np.abs(np.asarray(p, np.float64) - p_ref) <= tolerance), name
        else:
            for w0, w, (w_ref, _, _), (w_nano, _, _) in zip(torch_matrices(p0), torch_matrices(p), ref[name],
                                                            nanochat[name]):
                ours, theirs = rel_err(w - w0, w_ref - w0), rel_err(w_nano - w0, w_ref - w0)
                if compute_dtype == jnp.float32:  # the float32 polynomial: see the module's docstring
                    assert ours < 1e-4, (name, ours)
                else:  # bf16 Polar Express: no further from the float64 maths than nanochat's own bf16 (emulated)
                    assert theirs > 1e-3 and ours <= theirs, (name, ours, theirs)


# ---- schedules, batch size and scaling ----------------------------------------------------------------
def d20_horizon() -> tuple[int, int, float]:
    """(steps, batch, weight decay) of a 92d63d4 d20 run, by base_train.py's formulas."""
    target = int(12 * ref_scaling_params(20))
    d_ref = 12 * ref_scaling_params(12)
    batch = 2 ** round(math.log2(2**19 * (target / d_ref) ** 0.383))
    return target // batch, batch, 0.28 * math.sqrt(batch / 2**19) * d_ref / target


def test_schedules_equal_the_formulas_at_every_step_of_a_d20_horizon():
    n, _, wd = d20_horizon()
    steps = np.arange(n + 1)
    lrm = np.asarray(jax.jit(lambda s: lr_multiplier(s, n, 40, 0.65, 0.05))(steps), np.float64)
    momentum = np.asarray(jax.jit(lambda s: muon_momentum_92d63d4(s, n, 0.65))(steps), np.float64)
    decay = np.asarray(jax.jit(lambda s: weight_decay_cosine(s, wd, n))(steps), np.float64)
    # each is a few float32 operations on values <= 1 (times wd): a float32 ulp of 1 each, 8 in all
    atol = 8 * F32_EPS
    np.testing.assert_allclose(lrm, [ref_lr_multiplier(i, n, 40, 0.65, 0.05) for i in steps], rtol=0, atol=atol)
    np.testing.assert_allclose(momentum, [ref_momentum(i, n, 0.65) for i in steps], rtol=0, atol=atol)
    np.testing.assert_allclose(decay, [ref_weight_decay(i, wd, n) for i in steps], rtol=0, atol=atol * wd)
    assert n - round(0.65 * n) > 400  # the horizon holds every phase: momentum warmup, plateau, warmdown


@pytest.mark.parametrize("depth", [4, 12, 20, 26])
def test_the_scaling_count_written_here_is_jaxchats_92d63d4_gpts(depth):
    """ref_scaling_params (used by the rules below) against the count of the GPT jaxchat builds."""
    from jaxchat.model.gpt import GPTConfig, abstract_model

    config = GPTConfig.from_depth(depth, 32768, recipe="92d63d4")
    assert abstract_model(config).num_scaling_params() == ref_scaling_params(depth)


@pytest.mark.parametrize("depth", range(4, 27))
def test_batch_size_and_weight_decay_rules_over_depths(depth):
    target, d_ref = int(12 * ref_scaling_params(depth)), 12 * ref_scaling_params(12)
    batch = 2 ** round(math.log2(2**19 * (target / d_ref) ** 0.383))
    assert auto_total_batch_size(target, d_ref) == batch
    assert scaled_weight_decay_92d63d4(0.28, batch, target, d_ref) == pytest.approx(
        0.28 * math.sqrt(batch / 2**19) * d_ref / target, rel=1e-12)


def test_run_resolves_batch_horizon_and_decay_by_the_recipes_rules():
    """build_run at d4 against the formulas, with the counts of the model jaxchat builds (its own d12's too)."""
    from jaxchat.train.run import build_run

    def make(depth, **kw):
        return build_run(RunSettings.for_recipe("92d63d4", depth=depth, max_seq_len=64, device_batch_size=1,
                                                num_devices=1, **kw), 512)

    run, n12 = make(4), make(12, num_iterations=1).num_params
    target, d_ref = int(12.0 * run.num_params), 12.0 * n12
    batch = 2 ** round(math.log2(2**19 * (target / d_ref) ** 0.383))
    assert (run.total_batch_size, run.grad_accum_steps, run.num_iterations) == (batch, batch // 64, target // batch)
    wd = 0.28 * math.sqrt(batch / 2**19) * d_ref / target
    assert float(run.optimizer.weight_decay(0)) == pytest.approx(wd, rel=F32_EPS * 4)
    assert run.optimizer.learning_rates["muon"] == pytest.approx(0.02 * math.sqrt(batch / 2**19), rel=1e-12)


# ---- the command line -----------------------------------------------------------------------------------
def test_recipe_defaults_and_refusals_are_one_line():
    chosen = parse_settings(["--recipe=92d63d4"])
    assert (chosen.target_param_data_ratio, chosen.total_batch_size, chosen.unembedding_lr, chosen.weight_decay,
            chosen.warmup_steps, chosen.warmdown_ratio, chosen.final_lr_frac, chosen.eval_tokens) == \
        (12.0, -1, 0.008, 0.28, 40, 0.65, 0.05, 80 * 524288)
    for argv, message in [
        (["--recipe=92d63d4", "--adam-beta1=0.9"], "--adam-beta1 is not a setting of recipe 92d63d4: each AdamW group"),
        (["--recipe=92d63d4", "--warmup-ratio=0.1"], "--warmup-ratio is not a setting of recipe 92d63d4: it warms up "
                                                     "over a number of steps: use --warmup-steps"),
        (["--warmup-steps=10"], "--warmup-steps is not a setting of recipe bdcc030: it belongs to recipe(s) 92d63d4"),
        (["--total-batch-size=-1"], "-1, automatic, is a setting of recipe(s) 92d63d4 only"),
        (["--recipe=d5"], "--recipe 'd5' is not a recipe: use one of bdcc030, 92d63d4"),
    ]:
        with pytest.raises(SettingsError) as error:
            parse_settings(argv)
        assert message in str(error.value) and "\n" not in str(error.value), argv
