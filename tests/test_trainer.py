"""The jitted train step: gradient accumulation, sharding on 8 virtual devices (ZeRO-1 and FSDP), and no
recompilation while the schedules move (two processes agreeing with one: test_multihost.py)."""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxchat.model.gpt import GPTConfig
from jaxchat.distributed.mesh import DATA_AXIS, SHARDED, batch_sharding, logical_to_spec, make_mesh, put_batch
from jaxchat.optim.recipes import Optimizer, ParamLayout, setup_optimizer
from jaxchat.train.trainer import abstract_model, abstract_train_state, init_train_state, make_train_step

CONFIG = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL")


PARAMS = nnx.state(abstract_model(CONFIG), nnx.Param)  # shapes only


def real_optimizer(mesh, num_iterations=10, **kwargs):
    return setup_optimizer(PARAMS, model_dim=CONFIG.n_embd, depth=CONFIG.n_layer, num_iterations=num_iterations,
                           total_batch_size=4 * CONFIG.sequence_len, mesh=mesh, **kwargs)


def optimizer_of(tx: optax.GradientTransformation, mesh) -> Optimizer:
    """An Optimizer of any optax transformation over the same view as the real one's; no schedules."""
    constant = lambda step: jnp.zeros(jnp.shape(step))  # noqa: E731
    return Optimizer(tx, ParamLayout(PARAMS, mesh.shape[DATA_AXIS]), {}, constant, constant, constant)


def sgd(mesh):
    return optimizer_of(optax.sgd(1.0), mesh)


def random_batch(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CONFIG.vocab_size, size=shape).astype(np.int32)
    y = rng.integers(0, CONFIG.vocab_size, size=shape).astype(np.int32)
    return x, y


def perturb(params, seed=0):
    """Noise on every parameter: at init the projections are zero and the residual stream is a multiple of
    the embedding, which RMSNorm makes the loss blind to (x0_lambdas' gradient is ~0, Adam's first step
    then amplifies float noise). Away from init every gradient is well conditioned."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, noisy)


@functools.cache
def initial_params():
    """What every run_steps starts from, on the host (NumPy: device_put copies it, nothing donates it)."""
    return jax.device_get(perturb(init_train_state(CONFIG, sgd(make_mesh(1)), make_mesh(1), seed=3).params))


def run_steps(mesh, optimizer, batches, fsdp=False):
    # the shapes and shardings of init_train_state, with initial_params() in place of its initialisation
    # (the same program each time, but each mesh and optimizer would compile it anew: ~2 s of threefry)
    state = abstract_train_state(CONFIG, optimizer, mesh, fsdp=fsdp, seed=3)
    state.params = jax.device_put(initial_params(), state.param_shardings)
    state.opt_state = jax.jit(optimizer.init, out_shardings=state.opt_shardings)(state.params)
    step = make_train_step(state, optimizer, mesh)
    spec = batch_sharding(mesh)
    losses = []
    for x, y in batches:
        state.params, state.opt_state, metrics = step(state.params, state.opt_state, put_batch(x, spec), put_batch(y, spec))
        losses.append(float(metrics["loss"]))
    return state, losses


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def ulp(x: np.ndarray) -> np.float32:
    """The float32 spacing at x's largest magnitude: the rounding a stored parameter of that size carries."""
    return np.spacing(np.abs(x).max().astype(np.float32))


def assert_same_update(initial, a, b):
    """Parameters after steps of the real optimizer from gradients that agree to float32 rounding agree to a
    few percent of their change: its bf16 Polar Express (and Adam's sign-like first step on near-zero
    gradients) may round them differently. Each side is then stored in float32, which adds up to half an
    ulp of the parameter's magnitude. (Tests run it without weight decay: the cautious mask's sign test
    would turn such a rounding flip into a whole decay step on that element.)"""
    for p0, x, y in zip(host(initial), host(a), host(b)):
        change = np.abs(x - p0).max()
        assert change > 0
        assert np.abs(x - y).max() <= 0.05 * change + ulp(x)


def test_logical_axes_rules():
    mesh = make_mesh(8)
    assert logical_to_spec(("embed", "mlp"), (64, 256), SHARDED, mesh) == P("data", None)
    assert logical_to_spec(("mlp", "embed"), (256, 64), SHARDED, mesh) == P(None, "data")
    assert logical_to_spec(("vocab", "embed"), (256, 64), SHARDED, mesh) == P("data", None)  # one dim per mesh axis
    assert logical_to_spec(("layers",), (3,), SHARDED, mesh) == P(None)  # not divisible: replicated
    assert logical_to_spec(("matrices", None, None), (24, 64, 64), SHARDED, mesh) == P("data", None, None)
    assert logical_to_spec(("embed", "mlp"), (64, 256), {}, mesh) == P(None, None)


# SGD with learning rate 1 whose state is the gradient it was given (in the optimizer's view): the train
# step's averaged gradient comes back exactly, and the parameters move by exactly minus it.
SGD_KEEPING_THE_GRADIENT = optax.GradientTransformation(
    init=lambda view: jax.tree.map(jnp.zeros_like, view),
    update=lambda grads, state, view=None: (jax.tree.map(jnp.negative, grads), grads))


def test_accumulation_equals_one_big_batch():
    """4 micro-batches of 1 row == 1 micro-batch of 4 rows == the gradient of the mean loss over the 4 rows
    (jax.grad here, no train step): the loss, the gradients and the parameters after the update."""
    mesh = make_mesh(1)
    x, y = random_batch((1, 4, CONFIG.sequence_len))
    optimizer = optimizer_of(SGD_KEEPING_THE_GRADIENT, mesh)
    big, big_losses = run_steps(mesh, optimizer, [(x, y)])
    small, small_losses = run_steps(mesh, optimizer, [(x.reshape(4, 1, -1), y.reshape(4, 1, -1))])
    init = initial_params()
    graphdef = nnx.graphdef(abstract_model(CONFIG))
    loss, grads = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(x[0], y[0])))(init)
    # A mean of 128 per-token losses (~5.6) in another order and blocking: ~log2(128) eps32 ~ 1e-6 relative.
    # The 4 rows' own losses spread over ~0.15: a lost or mis-weighted micro-batch moves the mean by ~1e-3.
    np.testing.assert_allclose([big_losses[0], small_losses[0]], [loss, loss], rtol=1e-5)
    kept = [host(optimizer.layout.from_view(run.opt_state)) for run in (big, small)]
    for p0, g, g_big, g_small, p_big, p_small in zip(host(init), host(grads), *kept, host(big.params),
                                                     host(small.params)):
        # Each gradient element sums float32 terms over the 128 positions and the matmuls' 64..256 features:
        # summed in another order (one batch of 4 rows, 4 of 1, the reference) they differ by a few eps32 of
        # the leaf's largest element (4e-7 to 8e-7 measured), not of the element itself, which may be a
        # cancellation near 0. 1e-5 of the leaf's scale leaves 10x; a lost or mis-weighted micro-batch is off
        # by ~1/4 of the scale.
        scale = np.abs(g).max()
        assert scale > 0
        np.testing.assert_allclose(g_big, g, rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(g_small, g, rtol=0, atol=1e-5 * scale)
        # p0 - g rounds to float32 once on each side: the updated parameters differ by the gradients'
        # difference plus up to an ulp of the parameters' magnitude (not of the update's).
        np.testing.assert_allclose(p_small, p_big, rtol=0, atol=2e-5 * scale + ulp(p_big))
        np.testing.assert_allclose(p_big, p0 - g_big, rtol=0, atol=ulp(p_big))


@pytest.fixture(scope="module")
def one_device_run():
    """2 steps of the real optimizer (no weight decay) on 1 device: what every mesh must reproduce."""
    batches = [random_batch((2, 8, CONFIG.sequence_len), seed=s) for s in range(2)]
    single, losses = run_steps(make_mesh(1), real_optimizer(make_mesh(1), weight_decay=0.0), batches)
    return batches, single.params, losses


@pytest.mark.parametrize("fsdp", [False, True])
def test_eight_devices_equal_one(one_device_run, fsdp):
    batches, single_params, single_losses = one_device_run
    mesh = make_mesh(8)
    multi, multi_losses = run_steps(mesh, real_optimizer(mesh, weight_decay=0.0), batches, fsdp=fsdp)
    # Means of 512 per-token losses (~5.5), summed per device then across 8: a few eps32 relative (~1e-6);
    # the second step's loss also inherits the first update's rounding, a few percent of a ~1e-3 step.
    np.testing.assert_allclose(multi_losses, single_losses, rtol=1e-5)
    assert_same_update(initial_params(), multi.params, single_params)
    # ZeRO-1: Muon's stacks (the 2 c_fc kernels, padded to 8 matrices) are split over the 8 devices by whole
    # matrices; parameters replicated unless FSDP
    kernel = multi.params["blocks"][0]["mlp"]["c_fc"]["kernel"]
    assert kernel.sharding.spec == P("data", None) if fsdp else kernel.sharding.is_fully_replicated
    stacks = [x for x in jax.tree.leaves(multi.opt_state) if x.shape == (8, 64, 256)]
    assert stacks, "no stacked Muon buffer of the kernel's shape"
    for buf in stacks:
        assert buf.sharding.spec == P("data", None, None)
        assert buf.addressable_shards[0].data.shape == (1, 64, 256)


def test_no_recompilation_while_schedules_move(caplog):
    """10 steps whose learning rate (warmup, warmdown), momentum and weight decay all change: one compile."""
    mesh = make_mesh(2)
    opt = real_optimizer(mesh, num_iterations=10, warmup_ratio=0.3, warmdown_ratio=0.5)
    state = init_train_state(CONFIG, opt, mesh, seed=0)
    step = make_train_step(state, opt, mesh)
    spec = batch_sharding(mesh)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG, logger="jax"):
            for s in range(10):
                x, y = random_batch((1, 2, CONFIG.sequence_len), seed=s)
                state.params, state.opt_state, _ = step(state.params, state.opt_state, put_batch(x, spec), put_batch(y, spec))
            jax.block_until_ready(state.params)
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(train_step)")]
    assert len(compiles) == 1, [r.getMessage()[:80] for r in compiles]


def test_a_second_initialisation_of_the_same_model_has_arrays_of_its_own():
    """init_train_state keeps its jitted initialiser per process: a second state of the same model is the same
    values (the same program run twice: bit-exact) in buffers of its own, which outlive the first's (the train
    step donates them)."""
    mesh = make_mesh(2)
    first, second = (init_train_state(CONFIG, sgd(mesh), mesh, seed=4) for _ in range(2))
    kept = jax.device_get(first.params)
    jax.tree.map(lambda x: x.delete(), first.params)
    for want, got in zip(jax.tree.leaves(kept), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(got), want)
