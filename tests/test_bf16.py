"""bf16 numerics: no constant rounded to bf16 anywhere in the train step, and the bf16 forward against a
float64 NumPy forward, next to nanochat's own bf16 rounding of the same forward.

How a Python float meets a bf16 array in JAX: the float is weakly typed, so `8.156554 * x` runs in
bf16 and the float is rounded to bf16 first (8.1875), where PyTorch applies it in float32 and rounds
the product once. In the jaxpr (JAX 0.10) it is then a bf16 Literal that already holds 8.1875: the
value written in the code is gone, so the guard cannot ask whether it was representable. It flags
every bf16 literal or constant that is not a short binary number (at most 4 significant bits, as 0,
1, 2, 0.5, 3, 0.75; or ±inf, bf16's largest): a rounded arbitrary float keeps 7-8 significant bits.
(A float that rounds onto a short value, 0.5000178 -> 0.5, slips through; its neighbours do not.)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jcore
from flax import nnx
from jax.extend import source_info_util

from nanochat_numpy import bf16_round, np_forward, randomized, rel_err
from jaxchat.model.gpt import GPTConfig
from jaxchat.export.nanochat import from_nanochat_state_dict, to_nanochat_state_dict
from jaxchat.distributed.mesh import make_mesh
from jaxchat.optim.recipes import setup_optimizer
from jaxchat.train.trainer import abstract_model, abstract_train_state, make_train_step

CONFIG = GPTConfig(sequence_len=32, vocab_size=128, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL")
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)


def is_short(value: float) -> bool:
    """0, ±inf, ±bf16 max, or m·2^e with an integer |m| < 16."""
    if value == 0 or math.isinf(value) or abs(value) == BF16_MAX:
        return True
    mantissa, _ = math.frexp(abs(value))  # in [0.5, 1)
    return (mantissa * 16).is_integer()


def sub_jaxprs(params: dict):
    """The jaxprs in an equation's params: jit, scan, while, cond branches, remat, custom_jvp/vjp."""
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                yield item


def bf16_rounded_constants(jaxpr) -> list[tuple[float, str]]:
    """(value, where) of every bf16 floating literal or constant that is not short, in jaxpr and every
    jaxpr in it."""
    found = []
    if isinstance(jaxpr, jcore.ClosedJaxpr):
        for const in jaxpr.consts:
            if getattr(const, "dtype", None) == jnp.bfloat16:
                found += [(v, f"a constant {const.shape}") for v in np.asarray(const, np.float64).ravel()
                          if not is_short(v)]
        jaxpr = jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        for var in eqn.invars:
            if isinstance(var, jcore.Literal) and var.aval.dtype == jnp.bfloat16 and not is_short(float(var.val)):
                found.append((float(var.val), f"{eqn.primitive.name} at {source_info_util.summarize(eqn.source_info)}"))
        for sub in sub_jaxprs(eqn.params):
            found += bf16_rounded_constants(sub)
    return found


def float32_scalars_rounded_to_bf16(jaxpr) -> list[str]:
    """Where a float32 scalar computed in the step (a parameter, a schedule value) is cast to bf16."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jcore.ClosedJaxpr) else jaxpr
    found = []
    for eqn in jaxpr.eqns:
        if (eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.bfloat16
                and eqn.invars[0].aval.shape == () and eqn.invars[0].aval.dtype == jnp.float32):
            found.append(source_info_util.summarize(eqn.source_info))
        for sub in sub_jaxprs(eqn.params):
            found += float32_scalars_rounded_to_bf16(sub)
    return found


@pytest.fixture(scope="module")
def train_step_jaxpr():
    """The bf16 train step of jaxchat.train.trainer (grad accumulation scan, forward, loss, gradient, Muon
    split over 8 devices + AdamW, apply_updates), traced on shapes only."""
    mesh = make_mesh(8)
    optimizer = setup_optimizer(nnx.state(abstract_model(CONFIG), nnx.Param), model_dim=CONFIG.n_embd,
                                depth=CONFIG.n_layer, num_iterations=10, total_batch_size=2**19, mesh=mesh)
    state = abstract_train_state(CONFIG, optimizer, mesh, dtype=jnp.bfloat16, attention_implementation="xla")
    step = make_train_step(state, optimizer, mesh)
    tokens = jax.ShapeDtypeStruct((2, 8, CONFIG.sequence_len), jnp.int32)
    return jax.make_jaxpr(step)(state.params, state.opt_state, tokens, tokens)


def test_the_guard_sees_rounded_literals_in_every_kind_of_sub_jaxpr():
    # one coefficient per construct, each rounded to a different bf16 value: 8.1875, -22.5, 15.875,
    # 1.0234375, 0.94921875, 9.98e-07
    c_jit, c_scan, c_cond, c_remat, c_custom, c_grad = 8.156554524902461, -22.48329, 15.87877, 1.02, 0.95, 1e-6

    @jax.custom_vjp
    def custom(x):
        return x

    custom.defvjp(lambda x: (c_custom * x, None), lambda _, g: (g,))

    def loss(x):
        x = jax.jit(lambda y: c_jit * y)(x)
        x = jax.lax.scan(lambda c, _: (c_scan * c, None), x, None, length=2)[0]
        x = jax.lax.cond(x.sum() > 0, lambda y: c_cond * y, lambda y: y, x)
        x = jax.checkpoint(lambda y: jnp.sin(y) * c_remat)(x)
        x = custom(x) + c_grad
        return jnp.sum(x * 0.75)  # 0.75 is short: exact in bf16, not flagged

    found = bf16_rounded_constants(jax.make_jaxpr(jax.grad(loss))(jnp.ones((4,), jnp.bfloat16)))
    coefficients = (c_jit, c_scan, c_cond, c_remat, c_custom, c_grad)
    assert {value for value, _ in found} == {float(bf16_round(c)) for c in coefficients}, found
    # the same products with the bf16 operand cast up to float32 are clean
    assert not bf16_rounded_constants(jax.make_jaxpr(lambda x: x.astype(jnp.float32) * c_jit)(
        jnp.ones((4,), jnp.bfloat16)))


def test_no_constant_is_rounded_to_bf16_in_the_train_step(train_step_jaxpr):
    found = bf16_rounded_constants(train_step_jaxpr)
    assert not found, "apply these in float32 (cast the bf16 operand up), not rounded to bf16:\n" + "\n".join(
        f"{value} in {where}" for value, where in found)


def test_no_float32_scalar_is_rounded_to_bf16_in_the_train_step(train_step_jaxpr):
    found = float32_scalars_rounded_to_bf16(train_step_jaxpr)
    assert not found, "float32 scalars rounded to bf16 before use:\n" + "\n".join(found)


def test_bf16_forward_is_as_accurate_as_nanochats():
    """Logits of the bf16 forward against the float64 forward on the same weights, next to the float64
    forward rounded where nanochat rounds (bf16 autocast, wte in bf16): jaxchat's relative error must
    not exceed nanochat's. Measured over seeds 0-3: 0.87-0.92x (the residual mix in float32, the logits
    accumulated in float32); 0.97-1.01x with the lambdas rounded to bf16 and bf16 logits; 26-30x with
    bf16's epsilon in rms_norm (these embeddings have a mean square of 1/128, close to that epsilon)."""
    sd = to_nanochat_state_dict(randomized(CONFIG, seed=2))
    model = from_nanochat_state_dict(CONFIG, sd, dtype=jnp.bfloat16)
    idx = np.random.default_rng(0).integers(0, CONFIG.vocab_size, size=(2, CONFIG.sequence_len))
    exact = np_forward(sd, CONFIG, idx)
    ours = rel_err(np.asarray(model(jnp.asarray(idx)), np.float64), exact)
    nanochat = rel_err(np_forward(sd, CONFIG, idx, rnd=bf16_round), exact)
    assert 1e-3 < nanochat < 3e-2, nanochat  # bf16 rounding, not a broken reference
    assert ours <= nanochat, (ours, nanochat)
