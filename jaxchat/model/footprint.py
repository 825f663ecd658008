"""What one device holds during a train step, from abstract shapes (nothing allocated, nothing compiled),
and `--remat auto`'s choice from it.

The quick estimate per device: parameters, optimizer state, the float32 gradient accumulator, one
micro-step's gradients (an upper bound: as much again) and the activations the backward pass keeps (JAX's
saved residuals of one device's micro-batch). jaxchat.compiled.memory reports it with more (the largest lowered
tensors, the collectives); jaxchat.train.run uses it to resolve `--remat auto` before compiling.
"""

import math
import os
import re
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.common import per_process_cache
from jaxchat.model.gpt import GPTConfig, abstract_model

# Cheapest first: each policy recomputes more of a block in the backward pass and keeps less (jaxchat.model.gpt).
REMAT_BY_COST = ("none", "dots", "block")
# The share of the device's budget left to what the estimate does not see: XLA's scheduling and
# fragmentation. For d20 at device batch 32 compiled for H100s (docs/benchmarks.md) the estimate is above
# XLA's peak (41.38 against 39.72 GiB on one device, 39.03 against 36.71 on eight): its upper bound on the
# micro-step gradients covers XLA's temporaries, the loss head's float32 chunk (1 GiB) among them. What it
# cannot see is the order XLA schedules in: before the scheduler was told to order for memory, the
# 8-device peak was 49.80 GiB, 11 GiB above the estimate. A tenth of the budget (7.1 GiB of an H100's
# 71.2 GiB pool) keeps room for most of such a swing without pushing d20 B32 off `dots`.
XLA_MARGIN = 0.10


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs laid out by these shardings."""
    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings)
    return sum(jax.tree.leaves(sizes))


def state_bytes(state) -> dict[str, int]:
    """Per device, of an abstract jaxchat.train.trainer.TrainState: parameters, optimizer state, make_train_step's
    float32 gradient accumulator (the parameters' layout with FSDP, whole on each device with ZeRO-1: it is
    reduce-scattered once per step) and one micro-step's gradients (at most as much again)."""
    f32_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), state.params)
    grad_sum = per_device_bytes(f32_params, state.param_shardings)
    return {"parameters": per_device_bytes(state.params, state.param_shardings),
            "optimizer state": per_device_bytes(state.opt_state, state.opt_shardings),
            "gradient accumulator": grad_sum, "micro-step gradients (upper bound)": grad_sum}


def kept_activations(fn, *args) -> list[dict]:
    """What the backward pass of fn keeps from its forward pass (JAX's saved residuals), largest first,
    less fn's arguments themselves (parameters and batch exist anyway). Each: bytes, dtype, shape, source."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals, which prints the list

    kept = []
    for aval, source in saved_residuals(fn, *args):
        if source.startswith("from the argument"):
            continue
        source = re.sub(r"\S*/([\w.]+\.py)", r"\1", source)  # file names without their directories
        kept.append({"bytes": math.prod(aval.shape) * aval.dtype.itemsize, "dtype": str(aval.dtype),
                     "shape": tuple(aval.shape), "source": source})
    return sorted(kept, key=lambda r: -r["bytes"])


def model_kept_activations(config: GPTConfig, device_batch_size: int, max_seq_len: int, **model_kwargs) -> list[dict]:
    """kept_activations of the model's loss on one device's micro-batch, from shapes: a trace of the forward and
    its linearisation (~0.5 s at d2) kept per process, a list of its own for each caller."""
    return [dict(row) for row in _model_kept_activations(config, device_batch_size, max_seq_len, **model_kwargs)]


@per_process_cache
def _model_kept_activations(config: GPTConfig, device_batch_size: int, max_seq_len: int, **model_kwargs) -> list[dict]:
    graphdef, params = nnx.split(abstract_model(config, **model_kwargs))
    tokens = jax.ShapeDtypeStruct((device_batch_size, max_seq_len), jnp.int32)
    return kept_activations(lambda p, x, y: nnx.merge(graphdef, p)(x, y), params, tokens, tokens)


def remat_needs(state_total: int, kept_bytes: Callable[[str], int]) -> Iterable[tuple[str, int]]:
    """(policy, per-device bytes) cheapest policy first, each estimated only when asked for."""
    return ((policy, state_total + kept_bytes(policy)) for policy in REMAT_BY_COST)


def choose_remat(needs: Iterable[tuple[str, int]], budget_bytes: float) -> tuple[str, int, bool]:
    """The first (cheapest) policy whose need fits under budget_bytes less XLA_MARGIN of it: (policy, need,
    fits). When none fits, the last (the one that keeps least), with fits False. `needs` is consumed only
    up to the first fit, so a lazy one estimates no more policies than the decision reads."""
    room = (1 - XLA_MARGIN) * budget_bytes
    policy = need = None
    for policy, need in needs:
        if need <= room:
            return policy, need, True
    if policy is None:
        raise ValueError("no remat policy to choose from")
    return policy, need, False


def available_ram_bytes() -> int:
    """The machine's available memory (Linux's MemAvailable; else its free pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_budget(device: jax.Device) -> tuple[int, str]:
    """Bytes one device may use, and where the figure comes from: the allocator's bytes_limit where the
    backend reports it (on a GPU that is already XLA's pool at the memory fraction), else (the CPU backend
    reports none) the machine's available memory divided among this process's devices, which share it."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
        return int(limit), f"{device.platform} bytes_limit"
    share = len(jax.local_devices())
    return available_ram_bytes() // share, f"available RAM / {share} local device(s)"
