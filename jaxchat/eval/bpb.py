"""Bits per byte: the loss in bits per byte of text rather than per token, so that models with
different tokenizers (or vocabulary sizes) compare on the same footing (nanochat's nanochat/loss_eval.py).

    bpb = sum of losses (nats) over targets that stand for text / (ln 2 * sum of their bytes)

Targets that stand for no text are left out of both sums: ignored positions (target -1) and special
tokens such as BOS (token_bytes 0).
"""

import itertools
import math
from collections.abc import Iterable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxchat.distributed.mesh import batch_sharding, params_mesh, put_batch, rows_partitioned


@partial(jax.jit, static_argnums=(0, 1))
def _batch_sums(graphdef, mesh, state, inputs, targets, token_bytes):
    """(nats, bytes) of one global batch. The sums run over every device's rows: XLA all-reduces them."""
    with rows_partitioned(mesh):
        losses = nnx.merge(graphdef, state)(inputs, targets, loss_reduction="none")  # 0 where target == -1
    valid = targets >= 0
    num_bytes = jnp.where(valid, token_bytes[jnp.where(valid, targets, 0)], 0)
    return jnp.where(num_bytes > 0, losses, 0.0).sum(), num_bytes.sum()


def evaluate_bpb(model: nnx.Module, batches: Iterable, steps: int, token_bytes: np.ndarray,
                 mesh: Mesh | None = None) -> float:
    """Bits per byte of `model` over the first `steps` batches; every process must call it.

    batches: this process's (inputs, targets) int32 rows of shape (local_batch, T), e.g. from
    make_val_loader (or global arrays already sharded over the mesh). token_bytes: bytes per token
    id (0 for special tokens). Returns inf when no target stands for any byte.

    Nothing is read back until the end: each batch's (nats, bytes) stay on device and come back in
    one transfer, to be added up on the host in float64/int64 (a float32 running sum would drift
    and an int32 byte count overflow on long evaluations). The jitted function depends only on the
    model's structure, so evaluating new parameters of the same model never recompiles.
    """
    graphdef, state = nnx.split(model)
    mesh = mesh or params_mesh(state)
    rows = batch_sharding(mesh, ndim=2)
    token_bytes = jax.device_put(jnp.asarray(token_bytes, jnp.int32), NamedSharding(mesh, PartitionSpec()))
    sums = []
    for inputs, targets in itertools.islice(batches, steps):
        inputs, targets = (x if isinstance(x, jax.Array) else put_batch(np.asarray(x, np.int32), rows)
                           for x in (inputs, targets))
        sums.append(_batch_sums(graphdef, mesh, state, inputs, targets, token_bytes))
    if len(sums) < steps:
        raise ValueError(f"the batches ran out after {len(sums)} of {steps} steps")
    sums = jax.device_get(sums)
    total_nats = sum(float(nats) for nats, _ in sums)
    total_bytes = sum(int(num_bytes) for _, num_bytes in sums)
    if total_bytes == 0:
        return float("inf")
    return total_nats / (math.log(2) * total_bytes)
