"""The device mesh and how every array is laid out on it.

One mesh axis, 'data', over all devices of all processes; the batch is split over it.

Arrays are laid out by annotation, as in MaxText: every parameter carries logical axis names (given
where gpt.py creates it: 'vocab', 'embed', 'heads', 'mlp', 'layers'), optimizer buffers inherit the
names of the parameter they belong to, and Muon's stacked groups have a leading 'matrices' axis. A
rules table maps logical names to mesh axes; a dimension is split only if the mesh axis divides it and
no earlier dimension of the same array took that mesh axis, otherwise it is replicated.

    REPLICATED   parameters in data parallel: every device holds them
    SHARDED      optimizer state always (ZeRO-1, as nanochat's DistMuon/DistAdamW), parameters too
                 with --fsdp (ZeRO-3); Muon's stacked groups split by whole matrices

A (data, model) mesh is one more table mapping 'heads'/'mlp'/'vocab' to 'model'.
"""

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

DATA_AXIS = "data"

Rules = Mapping[str, str | None]
REPLICATED: Rules = {}
SHARDED: Rules = {"matrices": DATA_AXIS, "vocab": DATA_AXIS, "embed": DATA_AXIS}
# a batch of token rows: (micro-steps, rows, positions); (rows, positions) for evaluation
BATCH_AXES = ("accum", "batch", "seq")
BATCH_RULES: Rules = {"batch": DATA_AXIS}


# The default of --heartbeat-timeout: a process that sends the coordination service no heartbeat for this long
# is dead (JAX's own default: 100 s). The service then ends every other process (a native abort, status 134): a
# lost peer whose death no collective reports (a hang rather than an error) ends the job within this time rather
# than after 100 s. Heartbeats come from a thread of their own, so long compilations and steps do not miss them.
HEARTBEAT_TIMEOUT_S = 20


def maybe_initialize_distributed(heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
    """Start jax.distributed when the environment describes several processes.

    SLURM (srun with more than one task) and a Cloud TPU slice of several hosts (tpu_slice_hosts) are
    detected by JAX itself; elsewhere set JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID on every process. Must run before anything touches a JAX device. Returns whether it
    initialised.
    """
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
            heartbeat_timeout_seconds=heartbeat_timeout_s,
        )
        return True
    if (int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ) or tpu_slice_hosts() > 1:
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout_s)
        return True
    return False


GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on a Cloud TPU VM's PCI bus (how JAX's own hardware_utils finds them)
METADATA_HOST = "metadata.google.internal"  # GCE's metadata server; GCE_METADATA_IP overrides it, as in JAX


def tpu_slice_hosts(environ: Mapping[str, str] = os.environ, pci_devices: str = "/sys/bus/pci/devices",
                    timeout_s: float = 5.0) -> int:
    """How many hosts the Cloud TPU slice of this machine has: 1 off a TPU VM (no TPU chip on the PCI bus).
    On one, the workers' list: TPU_WORKER_HOSTNAMES where set (GKE), else the metadata server's
    worker-network-endpoints (a TPU VM made with gcloud), comma-separated both."""
    try:
        devices = os.listdir(pci_devices)
    except OSError:
        return 1
    if not any(_read_text(os.path.join(pci_devices, d, "vendor")) == GOOGLE_PCI_VENDOR for d in devices):
        return 1
    workers = environ.get("TPU_WORKER_HOSTNAMES") or _metadata("worker-network-endpoints", environ, timeout_s)
    return max(1, len([w for w in (workers or "").split(",") if w.strip()]))


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _metadata(key: str, environ: Mapping[str, str], timeout_s: float) -> str | None:
    """An attribute of this GCE instance from its metadata server (None if there is no answer)."""
    import urllib.request

    host = environ.get("GCE_METADATA_IP", METADATA_HOST)
    request = urllib.request.Request(f"http://{host}/computeMetadata/v1/instance/attributes/{key}",
                                     headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.read().decode()
    except OSError:
        return None


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


def logical_to_spec(axes: tuple, shape: tuple[int, ...], rules: Rules, mesh: Mesh) -> P:
    """The PartitionSpec of one array from its logical axis names (None: an unnamed dimension)."""
    spec, used = [], set()
    for name, size in zip(axes, shape):
        mesh_axis = rules.get(name) if name is not None else None
        if mesh_axis is None or mesh_axis in used or size % mesh.shape[mesh_axis]:
            spec.append(None)
        else:
            spec.append(mesh_axis)
            used.add(mesh_axis)
    return P(*spec)


def shardings(tree, axes: list[tuple], rules: Rules, mesh: Mesh):
    """NamedShardings of every leaf of tree (arrays or ShapeDtypeStructs); axes: the logical names of
    each leaf, in leaf order (gpt.logical_axes, optim.Optimizer.state_axes)."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(axes) != len(leaves):
        raise ValueError(f"{len(axes)} logical axis tuples for {len(leaves)} arrays")
    return treedef.unflatten([NamedSharding(mesh, logical_to_spec(a, x.shape, rules, mesh)) for x, a in zip(leaves, axes)])


def replicated(tree, mesh: Mesh):
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), tree)


def rows_partitioned(mesh: Mesh):
    """Trace inside this context a jitted function whose rows are sharded over the mesh and that XLA
    partitions itself (no shard_map around the model): kernels XLA cannot partition (Pallas' splash
    attention, jaxchat.model.splash_attention) then run per device on their rows."""
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def batch_sharding(mesh: Mesh, ndim: int = 3) -> NamedSharding:
    """Training batches are (grad_accum, batch, T), eval batches (batch, T): the rows split over 'data'."""
    axes = BATCH_AXES[-ndim:]
    return NamedSharding(mesh, P(*(BATCH_RULES.get(name) for name in axes)))


def put_batch(local_batch: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a batch -> the global array (each process holds the rows of its devices;
    the global shape follows from the sharding)."""
    return jax.make_array_from_process_local_data(sharding, local_batch)
