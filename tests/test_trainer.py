"""The jitted train step: gradient accumulation, sharding on 8 virtual devices (ZeRO-1 and FSDP),
multi-process agreement, and no recompilation while the schedules move."""

import logging
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from flax import nnx

from jaxchat.gpt import GPTConfig
from jaxchat.mesh import SHARDED, batch_sharding, logical_to_spec, make_mesh, put_batch
from jaxchat.optim import Optimizer, setup_optimizer
from jaxchat.trainer import abstract_model, init_train_state, make_train_step

CONFIG = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64, window_pattern="SL")
HERE = os.path.dirname(os.path.abspath(__file__))


PARAMS = nnx.state(abstract_model(CONFIG), nnx.Param)  # shapes only


def real_optimizer(mesh, num_iterations=10, **kwargs):
    return setup_optimizer(PARAMS, model_dim=CONFIG.n_embd, depth=CONFIG.n_layer, num_iterations=num_iterations,
                           total_batch_size=4 * CONFIG.sequence_len, mesh=mesh, **kwargs)


def sgd(mesh):
    return Optimizer.of_transform(optax.sgd(1.0), PARAMS, mesh)


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


def initial_params():
    """What every run_steps starts from, on the host."""
    return perturb(jax.device_get(init_train_state(CONFIG, sgd(make_mesh(1)), make_mesh(1), seed=3).params))


def run_steps(mesh, optimizer, batches, fsdp=False):
    state = init_train_state(CONFIG, optimizer, mesh, fsdp=fsdp, seed=3)
    state.params = jax.device_put(initial_params(), state.param_shardings)
    step = make_train_step(state, optimizer, mesh)
    spec = batch_sharding(mesh)
    losses = []
    for x, y in batches:
        state.params, state.opt_state, metrics = step(state.params, state.opt_state, put_batch(x, spec), put_batch(y, spec))
        losses.append(float(metrics["loss"]))
    return state, losses


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_same_update(initial, a, b):
    """Parameters after steps of the real optimizer from float32-equal gradients agree to a few percent of
    their change: its bf16 Polar Express (and Adam's sign-like first step on near-zero gradients) may round
    them differently. (Tests run it without weight decay: the cautious mask's sign test would turn such a
    rounding flip into a whole decay step on that element.)"""
    for p0, x, y in zip(host(initial), host(a), host(b)):
        change = np.abs(x - p0).max()
        assert change > 0
        assert np.abs(x - y).max() <= 0.05 * change + 1e-7


def test_logical_axes_rules():
    mesh = make_mesh(8)
    assert logical_to_spec(("embed", "mlp"), (64, 256), SHARDED, mesh) == P("data", None)
    assert logical_to_spec(("mlp", "embed"), (256, 64), SHARDED, mesh) == P(None, "data")
    assert logical_to_spec(("vocab", "embed"), (256, 64), SHARDED, mesh) == P("data", None)  # one dim per mesh axis
    assert logical_to_spec(("layers",), (3,), SHARDED, mesh) == P(None)  # not divisible: replicated
    assert logical_to_spec(("matrices", None, None), (24, 64, 64), SHARDED, mesh) == P("data", None, None)
    assert logical_to_spec(("embed", "mlp"), (64, 256), {}, mesh) == P(None, None)


def test_accumulation_equals_one_big_batch():
    """4 micro-batches of 1 row == 1 micro-batch of 4 rows: loss, gradients (SGD with lr 1 makes the
    parameter change the gradient itself) and the parameters after the update."""
    mesh = make_mesh(1)
    x, y = random_batch((1, 4, CONFIG.sequence_len))
    big, big_losses = run_steps(mesh, sgd(mesh), [(x, y)])
    small, small_losses = run_steps(mesh, sgd(mesh), [(x.reshape(4, 1, -1), y.reshape(4, 1, -1))])
    np.testing.assert_allclose(small_losses, big_losses, rtol=1e-6)
    init = initial_params()
    for p0, a, b in zip(host(init), host(big.params), host(small.params)):
        np.testing.assert_allclose(p0 - a, p0 - b, rtol=1e-4, atol=1e-7)  # the gradients
    # and through the real optimizer
    opt = real_optimizer(mesh, weight_decay=0.0)
    big, _ = run_steps(mesh, opt, [(x, y)])
    small, _ = run_steps(mesh, opt, [(x.reshape(4, 1, -1), y.reshape(4, 1, -1))])
    assert_same_update(init, big.params, small.params)


@pytest.mark.parametrize("fsdp", [False, True])
def test_eight_devices_equal_one(fsdp):
    batches = [random_batch((2, 8, CONFIG.sequence_len), seed=s) for s in range(2)]
    single, single_losses = run_steps(make_mesh(1), real_optimizer(make_mesh(1), weight_decay=0.0), batches)
    mesh = make_mesh(8)
    multi, multi_losses = run_steps(mesh, real_optimizer(mesh, weight_decay=0.0), batches, fsdp=fsdp)
    np.testing.assert_allclose(multi_losses, single_losses, rtol=1e-5)
    assert_same_update(initial_params(), multi.params, single.params)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(process_id, num_processes, devices_per_process, port):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}")
    if num_processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                   JAX_PROCESS_ID=str(process_id))
    return subprocess.Popen([sys.executable, os.path.join(HERE, "multiprocess_worker.py")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def worker_losses(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("LOSSES ")][-1]
    return [float(v) for v in line.split()[1:]]


def test_two_processes_agree_with_one():
    """2 processes x 2 CPU devices (jax.distributed on 127.0.0.1, gloo collectives) == 1 process x 4."""
    port = free_port()
    procs = [run_worker(i, 2, 2, port) for i in range(2)]
    single = run_worker(0, 1, 4, port)
    multi = [worker_losses(p) for p in procs]
    reference = worker_losses(single)
    assert len(reference) == 5
    np.testing.assert_allclose(multi[0], reference, rtol=1e-5)
    np.testing.assert_allclose(multi[1], multi[0], rtol=0)
