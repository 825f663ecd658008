"""The device mesh and how every array is laid out on it.

One mesh axis, 'data', over all devices of all processes. The batch is split over it. By default
parameters are replicated and the optimizer state is sharded over it (ZeRO-1, as nanochat's
DistMuon/DistAdamW); with fsdp=True the parameters are sharded the same way (ZeRO-3), for depths
whose state does not fit one device. XLA inserts the collectives: gradients are reduce-scattered
onto the optimizer's shards and the updated parameters all-gathered.

The sharding rule is a single function of the array's shape, so parameters, gradients, optimizer
state and checkpoints all agree without a table to maintain.
"""

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"


def maybe_initialize_distributed() -> bool:
    """Start jax.distributed when the environment describes several processes.

    SLURM (srun with more than one task) is detected by JAX itself; elsewhere set
    JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process.
    Must run before anything touches a JAX device. Returns whether it initialised.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
        return True
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        jax.distributed.initialize()
        return True
    return False


def make_mesh(num_devices: int | None = None, devices: list | None = None) -> Mesh:
    """A 1-D 'data' mesh over the first num_devices devices (default: all, of all processes)."""
    devices = list(devices if devices is not None else jax.devices())
    if num_devices is not None and num_devices > 0:
        if num_devices > len(devices):
            raise ValueError(f"{num_devices} devices requested but only {len(devices)} exist "
                             f"({devices[0].platform}); ask for at most {len(devices)}")
        devices = devices[:num_devices]
    return Mesh(np.array(devices), (DATA_AXIS,))


def params_mesh(state) -> Mesh:
    """The mesh the parameters live on, else a 'data' mesh over every device."""
    for leaf in jax.tree.leaves(state):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return leaf.sharding.mesh
    return make_mesh()


def shard_spec(shape: tuple[int, ...], axis_size: int) -> P:
    """Shard the largest dimension that the axis divides; replicate what nothing divides (scalars, odd shapes)."""
    candidates = [(size, -i) for i, size in enumerate(shape) if size % axis_size == 0 and size >= axis_size]
    if axis_size == 1 or not candidates:
        return P()
    _, neg_dim = max(candidates)
    spec = [None] * len(shape)
    spec[-neg_dim] = DATA_AXIS
    return P(*spec)


def sharded(tree, mesh: Mesh):
    """NamedShardings that split each leaf of tree (arrays or ShapeDtypeStructs) over 'data' by shard_spec."""
    size = mesh.shape[DATA_AXIS]
    return jax.tree.map(lambda x: NamedSharding(mesh, shard_spec(tuple(x.shape), size)), tree)


def replicated(tree, mesh: Mesh):
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def param_shardings(abstract_params, mesh: Mesh, fsdp: bool = False):
    """Replicated parameters (data parallel), or sharded over 'data' with fsdp."""
    return sharded(abstract_params, mesh) if fsdp else replicated(abstract_params, mesh)


def optimizer_state_shardings(abstract_opt_state, mesh: Mesh):
    """Optimizer state is always sharded over 'data' (ZeRO-1); step counts and scalars stay replicated."""
    return sharded(abstract_opt_state, mesh)


def batch_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """Training batches are (grad_accum, batch, T), eval batches (batch, T): split the rows over 'data'."""
    spec = [None] * ndim
    spec[ndim - 2] = DATA_AXIS
    return NamedSharding(mesh, P(*spec))


def put_batch(local_batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a batch -> the global array (each process holds the rows of its devices)."""
    global_shape = list(local_batch.shape)
    global_shape[-2] *= jax.process_count()
    return jax.make_array_from_process_local_data(sharding, local_batch, tuple(global_shape))
