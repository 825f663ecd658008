"""The train step timed on random tokens: compile time, steady-state step time, tok/s, model FLOP/s
(nanochat's estimate_flops per token), MFU against the device's bf16 peak -- on a CPU against a
float32 matmul rate measured here --, peak memory, and optionally forward+backward alone, one
optimizer update alone, and XLA's cost_analysis FLOPs of forward+backward against estimate_flops.
`scripts.bench train` and `scripts.gpu_check` print it; speed is measured there, never in tests.
"""

import dataclasses
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.common import peak_flops_per_device
from jaxchat.model.gpt import estimate_flops
from jaxchat.distributed.mesh import batch_sharding, make_mesh, put_batch
from jaxchat.optim.muon import polar_express_flops
from jaxchat.train.profiling import StepProfiler
from jaxchat.train.run import RunSettings, build_run


def timed(fn, *args, repeats: int) -> float:
    """Seconds per call of an already compiled fn, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list in older JAX versions
    return float((cost or {}).get("flops", 0.0))


def cpu_matmul_flops_per_s(n: int = 1024, repeats: int = 20) -> float:
    """float32 matmul rate of one CPU device: the denominator of MFU where no peak is published."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x).lower(a).compile()
    return 2 * n**3 / timed(matmul, a, repeats=repeats)


def peak_memory_bytes(devices) -> tuple[int, str]:
    """Peak device memory if the backend reports it, else the process's peak resident host memory."""
    stats = [d.memory_stats() or {} for d in devices]
    peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    if peak:
        return peak, "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"


def _breakdown(run, params, opt_state, inputs, targets, steps: int) -> tuple[float, float, float]:
    """(forward+backward of one micro-batch alone, one optimizer update alone, in seconds; XLA's FLOPs
    of forward+backward on one device)."""
    graphdef = run.state.graphdef

    def loss_fn(p, x, y):
        return nnx.merge(graphdef, p)(x, y)

    fwd_bwd = jax.jit(jax.value_and_grad(loss_fn)).lower(params, inputs[0], targets[0]).compile()
    fwd_bwd_s = timed(fwd_bwd, params, inputs[0], targets[0], repeats=steps)
    _, grads = fwd_bwd(params, inputs[0], targets[0])
    update = jax.jit(run.optimizer.update).lower(grads, opt_state, params).compile()
    return fwd_bwd_s, timed(update, grads, opt_state, params, repeats=steps), xla_flops(fwd_bwd)


def time_train_step(settings: RunSettings, vocab_size: int, *, grad_accum: int = 1, steps: int = 10,
                    breakdown: bool = True, profiler: StepProfiler | None = None) -> dict:
    """The train step that scripts.train builds for these settings (jaxchat.train.run), grad_accum
    micro-steps per step over settings.num_devices devices, on random tokens. breakdown=False leaves
    out forward+backward alone and the update alone (two more compilations). profiler: its window's steps
    run after the timed ones, outside their timing, traced (jaxchat.train.profiling)."""
    mesh = make_mesh(settings.num_devices)
    world = mesh.devices.size
    tokens_per_step = grad_accum * settings.device_batch_size * world * settings.max_seq_len
    settings = dataclasses.replace(settings, num_iterations=1000, total_batch_size=tokens_per_step, num_devices=world)
    run = build_run(settings, vocab_size, mesh=mesh)
    state = run.init_state()
    rng = np.random.default_rng(0)
    shape = (grad_accum, settings.device_batch_size * world, settings.max_seq_len)
    spec = batch_sharding(mesh)
    inputs = put_batch(rng.integers(0, vocab_size, shape, dtype=np.int32), spec)
    targets = put_batch(rng.integers(0, vocab_size, shape, dtype=np.int32), spec)

    # the whole train step, compiled once, as scripts.train runs it
    start = time.perf_counter()
    step = run.train_step().lower(state.params, state.opt_state, inputs, targets).compile()
    compile_s = time.perf_counter() - start
    params, opt_state = state.params, state.opt_state
    params, opt_state, metrics = step(params, opt_state, inputs, targets)  # warm-up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, inputs, targets)
    jax.block_until_ready((params, opt_state, metrics))
    step_s = (time.perf_counter() - start) / steps
    if profiler and profiler.start is not None:
        for n in range(profiler.start, profiler.stop):
            with profiler.step(n):
                params, opt_state, metrics = step(params, opt_state, inputs, targets)
            profiler.after_step(n, (params, opt_state, metrics))

    flops_per_token = estimate_flops(run.config)
    micro_tokens = settings.device_batch_size * world * settings.max_seq_len
    fwd_bwd_s = update_s = xla_over_estimate = None
    if breakdown:
        fwd_bwd_s, update_s, fwd_bwd_flops = _breakdown(run, params, opt_state, inputs, targets, steps)
        xla_over_estimate = fwd_bwd_flops * world / (flops_per_token * micro_tokens)

    tok_per_s = tokens_per_step / step_s
    model_flops_per_s = flops_per_token * tok_per_s
    device = mesh.devices.flat[0]
    peak, peak_kind = peak_flops_per_device(device), "bf16 peak"
    if peak is None and device.platform == "cpu":
        peak, peak_kind = cpu_matmul_flops_per_s(), "f32 matmul"
    memory, memory_kind = peak_memory_bytes(jax.local_devices())
    return {
        "config": f"d{settings.depth} T{settings.max_seq_len} B{settings.device_batch_size}x{world}x{grad_accum} "
                  f"V{vocab_size} {settings.window_pattern} remat={run.settings.remat}" + (" fsdp" if settings.fsdp else ""),
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "device": f"{world}x {device.device_kind}",
        "compile_s": compile_s,
        "step_ms": 1e3 * step_s,
        "fwd_bwd_ms": 1e3 * fwd_bwd_s if breakdown else None,
        "update_ms": 1e3 * update_s if breakdown else None,
        "update_share": update_s / step_s if breakdown else None,
        "tok_per_s": tok_per_s,
        "model_tflops": model_flops_per_s / 1e12,
        "mfu": model_flops_per_s / (peak * world) if peak else None,
        "mfu_against": peak_kind if peak else None,
        "xla_over_estimate": xla_over_estimate,
        # Polar Express costs the same whatever the batch: against the model's FLOPs of one whole step
        "polar_over_model": polar_express_flops(
            [x.shape for x in jax.tree.leaves(params["blocks"])]) / (flops_per_token * tokens_per_step),
        "peak_memory_gib": memory / 2**30,
        "memory_kind": memory_kind,
    }
