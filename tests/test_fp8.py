"""fp8 training (jaxchat/model/fp8.py): tensorwise quantisation, saturation and the three matmuls against a
float64 NumPy version of nanochat's scaling maths (nanochat/fp8.py at 92d63d4), the fp8 loss head,
non-finite inputs, the step lowered for CUDA, a d2 train step against the same step without fp8, and
an fp8-trained checkpoint against one trained without."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxchat.model import fp8, gpt
from jaxchat.checkpoint.manager import RunCheckpoints
from jaxchat.export.nanochat import to_nanochat_state_dict
from jaxchat.model.loss import LOGIT_SOFTCAP, token_losses
from jaxchat.distributed.mesh import batch_sharding, make_mesh, put_batch
from jaxchat.train.run import RunSettings, SettingsError, abstract_step_arguments, build_run
from jaxchat.train.trainer import TrainState, abstract_model

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
    """The documented outcome (jaxchat/model/fp8.py): an inf or NaN anywhere in an operand gives NaN in every
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
    e5m2 with its own scale (jaxchat/model/loss.py). The reference does the same in float64 from the same
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


# ---- the train step: settings, lowering for CUDA, one step against the same step without fp8 ----------
VOCAB = 300  # padded to 320: lm_head passes nanochat's filter (min 128, multiples of 16) as at d2 every block's layers
D2 = dict(depth=2, max_seq_len=32, device_batch_size=2, total_batch_size=64, num_iterations=4, seed=3, remat="dots")


def d2_run(fp8_on: bool, **overrides):
    return build_run(RunSettings(**{**D2, "fp8": fp8_on, **overrides}), VOCAB, mesh=make_mesh(1))


def test_rowwise_is_refused_in_one_line():
    with pytest.raises(SettingsError, match="--fp8-recipe 'rowwise' is not supported: only 'tensorwise'"):
        RunSettings(fp8=True, fp8_recipe="rowwise").check()
    RunSettings(fp8=True, fp8_recipe="tensorwise").check()


def test_nanochats_filter_and_eval_without_fp8():
    """Every linear layer of d2 is 128 wide or more and a multiple of 16, so all 13 (12 in the blocks and
    lm_head) train in fp8; at vocabulary 100 (padded 128) too, at 50 (padded 64) lm_head stays out.
    TrainState.model(), what evaluation and sampling use, has every fp8 matmul off."""
    run = d2_run(True)
    model = nnx.merge(run.state.graphdef, run.state.params)
    assert len(linear_layers(model)) == sum(isinstance(node, nnx.Linear) for _, node in nnx.iter_graph(model)) == 13
    assert [layer.fp8_enabled for layer in linear_layers(model)] == [True] * 13
    assert not any(layer.fp8_enabled for layer in linear_layers(run.state.model()))
    for vocab, converted in ((100, 13), (50, 12)):
        assert gpt.use_fp8(abstract_model(dataclasses.replace(run.config, vocab_size=vocab))) == (converted, 13)
    assert [fp8.eligible(*dims) for dims in [(128, 128), (128, 64), (96, 256), (256, 120), (1280, 65536)]] == \
        [True, False, False, False, True]


def linear_layers(model) -> list:
    return [node for _, node in nnx.iter_graph(model) if isinstance(node, gpt.Linear)]


def test_the_step_lowered_for_cuda_has_fp8_dots():
    """The whole train step (bf16 compute, remat 'dots') lowered for CUDA without a GPU: every matmul
    without batch dimensions (attention's and Muon's stacks have them) takes fp8 operands, in nanochat's
    pairing (e4m3 x e4m3 forward, e5m2 x e4m3 dgrad, e4m3 x e5m2 wgrad), once per layer and pass: 13
    forward, 13 dgrad, 13 wgrad (the loss head's computes its chunk's logits once, jaxchat.model.loss). Each fp8
    product is multiplied by one scalar (the product of the two inverse scales), which is what XLA's
    GemmRewriter folds into the cuBLASLt fp8 GEMM."""
    run = d2_run(True, compute_dtype="bfloat16", attention="xla", remat="dots")
    text = run.train_step().trace(*abstract_step_arguments(run)).lower(lowering_platforms=("cuda",)).as_text()
    kinds, scaled = [], 0
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "stablehlo.dot_general" not in line or "batching_dims" in line:
            continue
        operands = re.search(r": \(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)", line).groups()
        kinds.append(operands)
        result = re.match(r"\s*(%\S+) =", line).group(1)
        # the next use of the product: a multiply by a broadcast scalar
        use = next(l for l in lines[i + 1:] if re.search(rf"{re.escape(result)}\b", l))
        broadcast = re.search(r"stablehlo.multiply %\S+, (%\S+) ", use)
        if broadcast and re.search(rf"{re.escape(broadcast.group(1))} = stablehlo.broadcast_in_dim %\S+, dims = \[\] : \(tensor<(f32|bf16)>\)", text):
            scaled += 1
    E4, E5 = "f8E4M3FN", "f8E5M2"
    assert sorted(kinds) == sorted([(E4, E4)] * 13 + [(E5, E4)] * 13 + [(E4, E5)] * 13), kinds
    assert scaled == len(kinds)


@pytest.mark.cuda_plugin
def test_the_step_compiled_for_an_h100_runs_its_fp8_dots_as_fp8_cublaslt_gemms():
    """The d2 --fp8 step compiled for one H100 (XLA:GPU's whole pipeline, no GPU): every fp8 matmul is an fp8
    cuBLASLt GEMM (`__cublas$lt$matmul$f8`), 14 per layer (XLA merges the q, k, v matmuls that share their
    input, and their wgrads: 6 + 6 + 6 - 4) and 3 for the loss head (forward, dgrad, wgrad), as
    docs/benchmarks.md counts them; and nothing in the program is f16. A target without a CUDA version
    (jaxchat/compiled/targets' runtime_version) compiles them as f16 GEMMs of upcast e4m3 values instead."""
    from jaxchat.compiled.compile_only import compile_for_target

    depth = 2
    settings = RunSettings(depth=depth, max_seq_len=256, device_batch_size=2, remat="dots", fp8=True)
    compiled = compile_for_target(settings, 1024, 1)
    assert compiled["kernels"]["gemm"].get("cublaslt_fp8") == 14 * depth + 3, compiled["kernels"]["gemm"]
    assert not re.search(r"(?<![\w])f16\[", compiled["hlo"])  # (bf16 is \w-prefixed: not counted)


def rounding_sensitivities(monkeypatch, graphdef, params, idx, targets) -> np.ndarray:
    """|dL/da| (u |a| + s_a) for every operand element a of the forward's fp8 matmuls, on the model without
    fp8: how far e4m3's rounding of a can move the loss, to first order. The activations' part comes from
    additive probes on the input of each linear layer and of the loss head; the weights' from their
    gradients. u = 2^-4 bounds e4m3's relative rounding of a normal value; s_a = 2^-10 amax / 448 is half
    the subnormal spacing, unscaled."""
    inputs, probes = [], []
    linear_call, loss_head = gpt.Linear.__call__, gpt.token_losses

    def probe(x):
        x = x + probes.pop(0) if probes else x
        inputs.append(x)
        return x

    def loss(p, e):
        probes[:] = list(e)
        return nnx.merge(graphdef, p)(idx, targets)

    monkeypatch.setattr(gpt.Linear, "__call__", lambda self, x: linear_call(self, probe(x)))
    monkeypatch.setattr(gpt, "token_losses", lambda x, *args, **kwargs: loss_head(probe(x), *args, **kwargs))
    def record(p):  # the inputs of the 12 block layers, then the loss head's
        loss(p, [])
        return list(inputs)

    values = [np.asarray(x, np.float64) for x in jax.jit(record)(params)]
    grads_p, grads_e = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, [jnp.zeros(x.shape) for x in values])
    monkeypatch.undo()
    kernels = [np.asarray(layer.kernel[...], np.float64) for layer in linear_layers(nnx.merge(graphdef, params))]
    kernel_grads = [np.asarray(layer.kernel[...]) for layer in linear_layers(nnx.merge(graphdef, grads_p))]
    return np.concatenate([(np.abs(g) * (2.0 ** -4 * np.abs(a) + 2.0 ** -10 * np.abs(a).max() / 448)).ravel()
                           for g, a in zip([*grads_e, *kernel_grads], [*values, *kernels])])


@functools.cache
def d2(fp8_on: bool):
    """A d2 run, its jitted step (compiled once for the tests that share it) and its initial state on the
    host (the step donates what it is given)."""
    run = d2_run(fp8_on)
    state = run.init_state()
    return run, run.train_step(), jax.device_get(state.params), jax.device_get(state.opt_state)


def perturbed_params():
    """The initial parameters plus noise: at init the projections are zero (no rounding to see)."""
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda x: (x + 0.05 * rng.standard_normal(x.shape)).astype(x.dtype), d2(False)[2])


def d2_batch(seed=0):
    rng = np.random.default_rng(seed)
    spec = batch_sharding(make_mesh(1))
    return [put_batch(rng.integers(0, VOCAB, size=(1, 2, 32)).astype(np.int32), spec) for _ in range(2)]


def one_step(fp8_on: bool, params, opt_state, batch):
    """One step of the d2 run from host copies of its state; returns the new (params, opt_state) and the loss."""
    run, step, _, _ = d2(fp8_on)
    params, opt_state, metrics = step(jax.device_put(params, run.state.param_shardings),
                                      jax.device_put(opt_state, run.state.opt_shardings), *batch)
    return params, opt_state, float(metrics["loss"])


def test_one_d2_step_with_and_without_fp8(monkeypatch):
    """The same weights and batch, one step of each (float32 compute on CPU, remat 'dots'). Its loss is
    the forward's; the fp8 forward rounds every operand a of its 13 matmuls to e4m3 (a -> a + da with
    |da| <= c_a = u |a| + s_a), and to first order the loss moves by sum_a dL/da da. Taken one by one the
    roundings could all push the same way (sum |dL/da| c_a: 4.7 here, most of the loss); as independent
    zero-mean errors (the standard model of rounding error), Hoeffding's inequality bounds the sum by
    t = sqrt(2 ln(2 / p) sum (|dL/da| c_a)^2) but with probability p; p = 1e-9 gives 6.5 standard
    deviations' worth. Terms of second order are smaller by another factor of about u (1/16): twice t
    holds them. The updated weights are ordinary float32 arrays of the same tree."""
    params, batch = perturbed_params(), d2_batch()
    params_ref, _, loss_ref = one_step(False, params, d2(False)[3], batch)
    params_f8, _, loss_f8 = one_step(True, params, d2(True)[3], batch)
    graphdef = nnx.split(abstract_model(d2(False)[0].config, remat="none"))[0]  # no remat: the probes record once
    c = rounding_sensitivities(monkeypatch, graphdef, jax.device_put(params), batch[0][0], batch[1][0])
    bound = 2 * math.sqrt(2 * math.log(2 / 1e-9) * np.sum(c**2))
    assert abs(loss_f8 - loss_ref) <= bound, (loss_f8, loss_ref, bound)
    assert 0 < bound < 0.05 * loss_ref  # a bound on rounding (0.17 against a loss of 5.87), not on anything at all
    assert jax.tree.structure(params_f8) == jax.tree.structure(params_ref)
    for a, b in zip(jax.tree.leaves(params_f8), jax.tree.leaves(params_ref)):
        assert a.dtype == b.dtype == jnp.float32 and np.isfinite(np.asarray(a)).all()


def test_an_fp8_run_resumes_and_exports_as_any_other(tmp_path):
    """The weights of an fp8 run are ordinary float32 parameters: its checkpoint restores into an fp8 run
    and continues exactly (the same program twice: bit-exact), restores into a run without fp8 unchanged,
    and exports (nanochat's state dict; TrainState.model(), fp8 off) as a run without fp8 does."""
    (f8, _, params0, opt0), (plain, _, _, _) = d2(True), d2(False)
    params, opt_state, _ = one_step(True, params0, opt0, d2_batch(1))
    meta = {"val_bpb": None, "model_config": {}, "user_config": {}, "device_batch_size": 2, "max_seq_len": 32,
            "loop_state": {}, "tokenizer": {}}
    with RunCheckpoints(str(tmp_path), async_save=False) as saver:
        saver.save(1, params, opt_state, None, meta)
    saved, saved_opt = jax.device_get(params), jax.device_get(opt_state)
    after_two = one_step(True, saved, saved_opt, d2_batch(2))[0]

    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    with RunCheckpoints(str(tmp_path)) as loader:
        params, opt_state, _ = loader.restore(1, shapes(params0), shapes(opt0), f8.state.param_shardings,
                                              f8.state.opt_shardings)
        resumed = one_step(True, jax.device_get(params), jax.device_get(opt_state), d2_batch(2))[0]
        plain_params, _, _ = loader.restore(1, shapes(params0), None, plain.state.param_shardings)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(after_two)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree.structure(plain_params) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(plain_params), jax.tree.leaves(saved)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)

    exported = TrainState(f8.state.graphdef, jax.device_put(saved), None, None, None).model()  # as export/eval read it
    without_fp8 = nnx.merge(plain.state.graphdef, plain_params)
    exported_dict = to_nanochat_state_dict(exported)
    for name, value in to_nanochat_state_dict(without_fp8).items():
        np.testing.assert_array_equal(exported_dict[name], value)
    idx = d2_batch(3)[0][0]
    np.testing.assert_array_equal(np.asarray(exported(idx)), np.asarray(without_fp8(idx)))  # same program: bit-exact


def test_what_each_remat_policy_keeps_with_fp8():
    """bf16 compute, from shapes only (what the backward pass keeps, less the arguments). Without remat an
    fp8 matmul keeps its e4m3 operands (1 byte each) where a bf16 one keeps its bf16 input: less. With
    'dots' a block's fp8 matmul keeps its bf16 result, as a bf16 matmul does, never its float32 product:
    the blocks keep the same bytes, and the loss head (outside the blocks' remat) keeps its gradients dx
    and dw, computed in its forward pass (jaxchat.model.loss), with fp8 or without: the same bytes in all.
    'block' keeps each block's input either way: again the same."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

    B, T, C, V = 2, 64, 128, 320
    config = gpt.GPTConfig(sequence_len=T, vocab_size=V, n_layer=2, n_head=1, n_kv_head=1, n_embd=C)
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def kept(remat, fp8_on):
        graphdef, params = nnx.split(abstract_model(config, dtype=jnp.bfloat16, remat=remat, fp8=fp8_on))
        residuals = saved_residuals(lambda p, x, y: nnx.merge(graphdef, p)(x, y), params, tokens, tokens)
        return [aval for aval, source in residuals if not source.startswith("from the argument")]

    def nbytes(avals):
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in avals)

    none, none_f8 = kept("none", False), kept("none", True)
    assert nbytes(none_f8) < nbytes(none) and any(a.dtype == jnp.float8_e4m3fn for a in none_f8)
    dots, dots_f8 = kept("dots", False), kept("dots", True)
    assert nbytes(dots_f8) == nbytes(dots)
    assert not [a for a in dots_f8 if a.dtype == jnp.float32 and a.shape in ((B * T, C), (B * T, 4 * C))]
    assert nbytes(kept("block", True)) == nbytes(kept("block", False))
