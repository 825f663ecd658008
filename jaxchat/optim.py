"""The optimizer of base training: Muon for the block matrices, AdamW for everything else, as one
optax.partition, with nanochat's scaling rules and schedules (SPEC §5-6, base_train.py).

The schedules are pure functions of the step, written with jnp so they work on traced steps inside
the optimizer and on Python ints for printing. Each transform counts its own updates from 0, so the
update at step t uses exactly the values nanochat uses at step t.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxchat.mesh import DATA_AXIS
from jaxchat.muon import muon

REFERENCE_BATCH_SIZE = 2**19  # tokens; the learning rates were tuned at this batch size
REFERENCE_MODEL_DIM = 768  # the AdamW learning rates of wte and lm_head were tuned at this width
REFERENCE_DEPTH = 12  # weight decay was tuned at d12
MUON_MOMENTUM_WARMUP_STEPS = 300
ADAM_EPS = 1e-10

# the AdamW groups, by the top-level name of the parameter; every block matrix goes to Muon
ADAMW_GROUPS = ("wte", "lm_head", "resid_lambdas", "x0_lambdas")
MUON_GROUP = "muon"


# ---- schedules -----------------------------------------------------------------------------------
def lr_multiplier(step, num_iterations: int, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float):
    """Linear warmup over round(warmup_ratio·N) steps, 1.0, then linear warmdown over the last
    round(warmdown_ratio·N) steps to final_lr_frac (reached at step N)."""
    warmup_iters = round(warmup_ratio * num_iterations)
    warmdown_iters = round(warmdown_ratio * num_iterations)
    it = jnp.asarray(step, jnp.float32)
    warmup = (it + 1) / max(warmup_iters, 1)
    progress = (num_iterations - it) / max(warmdown_iters, 1)
    warmdown = progress + (1 - progress) * final_lr_frac
    return jnp.where(it < warmup_iters, warmup, jnp.where(it <= num_iterations - warmdown_iters, 1.0, warmdown))


def muon_momentum(step):
    """0.85 -> 0.95 linearly over the first 300 steps."""
    frac = jnp.minimum(jnp.asarray(step, jnp.float32) / MUON_MOMENTUM_WARMUP_STEPS, 1.0)
    return (1 - frac) * 0.85 + frac * 0.95


def weight_decay_at(step, weight_decay_scaled: float, num_iterations: int):
    """Muon's weight decay, linearly to zero at step num_iterations (as (N - step) / N: no float32
    cancellation near the end)."""
    return weight_decay_scaled * (num_iterations - jnp.asarray(step, jnp.float32)) / num_iterations


# ---- scaling rules -------------------------------------------------------------------------------
def batch_lr_scale(total_batch_size: int) -> float:
    """sqrt(B / 2^19): the learning rates scale with the square root of the batch size."""
    return (total_batch_size / REFERENCE_BATCH_SIZE) ** 0.5


def scaled_weight_decay(weight_decay: float, depth: int) -> float:
    """Weight decay ∝ 1/width² (= 1/depth² at a fixed aspect ratio), tuned at d12."""
    return weight_decay * (REFERENCE_DEPTH / depth) ** 2


def group_learning_rates(
    *,
    model_dim: int,
    total_batch_size: int,
    unembedding_lr: float,
    embedding_lr: float,
    matrix_lr: float,
    scalar_lr: float,
) -> dict[str, float]:
    """Peak learning rate of each group (before the lr multiplier)."""
    batch_scale = batch_lr_scale(total_batch_size)
    dmodel_scale = (model_dim / REFERENCE_MODEL_DIM) ** -0.5
    return {
        MUON_GROUP: matrix_lr * batch_scale,
        "wte": embedding_lr * batch_scale * dmodel_scale,
        "lm_head": unembedding_lr * batch_scale * dmodel_scale,
        "resid_lambdas": scalar_lr * batch_scale * 0.01,
        "x0_lambdas": scalar_lr * batch_scale,
    }


# ---- parameter labels ----------------------------------------------------------------------------
def _key_name(key) -> str | int:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def param_path(path) -> tuple:
    """('blocks', 0, 'attn', 'c_q', 'kernel') from a jax key path (nnx's trailing .value dropped)."""
    names = tuple(_key_name(k) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def param_label(path: tuple, ndim: int) -> str:
    """The optimizer group of one parameter; an error that names it if it has none."""
    if path and path[0] == "blocks" and ndim >= 2:
        return MUON_GROUP
    if path and path[0] in ADAMW_GROUPS:
        return path[0]
    raise ValueError(
        f"parameter {'/'.join(map(str, path))} (ndim {ndim}) has no optimizer group: jaxchat.optim puts "
        f"matrices under 'blocks' in Muon and {', '.join(ADAMW_GROUPS)} in AdamW; add a rule for it there"
    )


def label_params(params):
    """The group label of every leaf of a parameter pytree (arrays or ShapeDtypeStructs)."""
    return jax.tree_util.tree_map_with_path(lambda path, p: param_label(param_path(path), p.ndim), params)


# ---- the optimizer -------------------------------------------------------------------------------
def setup_optimizer(
    params=None,
    *,
    model_dim: int,
    depth: int,
    num_iterations: int,
    total_batch_size: int,
    unembedding_lr: float = 0.004,
    embedding_lr: float = 0.3,
    matrix_lr: float = 0.02,
    scalar_lr: float = 0.5,
    weight_decay: float = 0.2,
    adam_betas: tuple[float, float] = (0.8, 0.95),
    warmup_ratio: float = 0.0,
    warmdown_ratio: float = 0.4,
    final_lr_frac: float = 0.0,
    mesh: Mesh | None = None,
    print_fn: Callable[[str], None] | None = None,
) -> optax.GradientTransformation:
    """nanochat's two optimizers as one optax transformation over the model's parameter pytree.

    The keyword arguments are base_train.py's flags; the scaling rules and schedules are applied here.
    params: the parameters or their shapes (optional): checked now that every one has a group (else
    at init), and counted in what print_fn prints.
    mesh: Muon's orthogonalisation is split over its 'data' axis (as nanochat's DistMuon).
    print_fn: prints the scaling rules and the groups (e.g. print0).
    """
    if num_iterations <= 0:
        raise ValueError(f"num_iterations must be positive, got {num_iterations}")
    if params is not None:
        label_params(params)  # fail now, naming the parameter, rather than inside jit
    lrs = group_learning_rates(
        model_dim=model_dim,
        total_batch_size=total_batch_size,
        unembedding_lr=unembedding_lr,
        embedding_lr=embedding_lr,
        matrix_lr=matrix_lr,
        scalar_lr=scalar_lr,
    )
    wd = scaled_weight_decay(weight_decay, depth)
    shard = (mesh, DATA_AXIS) if mesh is not None and mesh.shape.get(DATA_AXIS, 1) > 1 else None
    if print_fn is not None:
        if total_batch_size != REFERENCE_BATCH_SIZE:
            print_fn(f"Scaling LRs by {batch_lr_scale(total_batch_size):.4f} for batch size {total_batch_size:,} "
                     f"(reference: {REFERENCE_BATCH_SIZE:,})")
        if depth != REFERENCE_DEPTH:
            print_fn(f"Scaling weight decay from {weight_decay:.6f} to {wd:.6f} for depth {depth}")
        print_fn(f"Scaling the LR for the AdamW parameters ∝1/√({model_dim}/{REFERENCE_MODEL_DIM}) = "
                 f"{(model_dim / REFERENCE_MODEL_DIM) ** -0.5:.6f}")
        for line in describe_param_groups(lrs, params):
            print_fn(line)
        if shard is not None:
            print_fn(f"Muon: each stacked group's orthogonalisation is split over {mesh.shape[DATA_AXIS]} devices")

    def scheduled(peak_lr: float) -> Callable:
        return lambda count: peak_lr * lr_multiplier(count, num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac)

    b1, b2 = adam_betas
    transforms = {
        name: optax.adam(scheduled(lrs[name]), b1=b1, b2=b2, eps=ADAM_EPS) for name in ADAMW_GROUPS
    }
    transforms[MUON_GROUP] = muon(
        learning_rate=scheduled(lrs[MUON_GROUP]),
        momentum=muon_momentum,
        weight_decay=lambda count: weight_decay_at(count, wd, num_iterations),
        shard=shard,
    )
    return optax.partition(transforms, label_params)


def describe_param_groups(learning_rates: dict[str, float], params=None) -> list[str]:
    """One line per group: its peak lr, and with params its tensors, elements and Muon's stacked shapes."""
    labels = jax.tree.leaves(label_params(params)) if params is not None else []
    leaves = jax.tree.leaves(params) if params is not None else []
    lines = []
    for name in (MUON_GROUP, *ADAMW_GROUPS):
        line = f"{name:>13}: lr {learning_rates[name]:<11.6g}"
        if params is not None:
            members = [p for p, label in zip(leaves, labels) if label == name]
            numel = sum(math.prod(p.shape) for p in members)
            line += f" | {len(members):3d} tensors, {numel:>13,} params"
            if name == MUON_GROUP:
                stacks: dict[tuple, int] = {}
                for p in members:  # a leading layer axis counts as that many matrices
                    stacks[p.shape[-2:]] = stacks.get(p.shape[-2:], 0) + math.prod(p.shape[:-2])
                line += " | stacked " + ", ".join(f"{n}x{r}x{c}" for (r, c), n in stacks.items())
        lines.append(line.rstrip())
    return lines
