"""The optimizer of base training: Muon for the block matrices, AdamW for everything else, as one
optax.partition, with the scaling rules and schedules of nanochat's scripts/base_train.py (the commit in the README).

The schedules are pure functions of the step, written with jnp so they work on traced steps inside
the optimizer and on Python ints for printing. Each transform counts its own updates from 0, so the
update at step t uses exactly the values nanochat uses at step t.
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxchat.common import key_name
from jaxchat.mesh import DATA_AXIS
from jaxchat.muon import muon

REFERENCE_BATCH_SIZE = 2**19  # tokens; the learning rates were tuned at this batch size
REFERENCE_MODEL_DIM = 768  # the AdamW learning rates of wte and lm_head were tuned at this width
REFERENCE_DEPTH = 12  # weight decay was tuned at d12
MUON_MOMENTUM_WARMUP_STEPS = 300
ADAM_EPS = 1e-10

# The AdamW group of each top-level parameter name; every matrix under 'blocks' goes to Muon (the 92d63d4
# value-embedding gates blocks.<i>.attn.ve_gate included, as nanochat 92d63d4's setup_optimizer). The last
# rows are the parameters of the 92d63d4 GPT, in the groups that commit gives them.
ADAMW_GROUP_OF = {
    "wte": "wte",
    "lm_head": "lm_head",
    "resid_lambdas": "resid_lambdas",
    "x0_lambdas": "x0_lambdas",
    "value_embeds": "value_embeds",  # embedding-like, at half wte's learning rate
    "smear_gate": "smear",  # the smear and backout scalars and gate: one scalar-like group at a fixed lr
    "smear_lambda": "smear",
    "backout_lambda": "smear",
}
ADAMW_GROUPS = tuple(dict.fromkeys(ADAMW_GROUP_OF.values()))
MUON_GROUP = "muon"
VALUE_EMBEDS_LR_FACTOR = 0.5  # value embeddings' lr relative to wte's (nanochat 92d63d4 setup_optimizer)
SMEAR_LR = 0.2  # nanochat 92d63d4 setup_optimizer: fixed, scaled neither by batch size nor by width


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
        "value_embeds": embedding_lr * batch_scale * dmodel_scale * VALUE_EMBEDS_LR_FACTOR,
        "smear": SMEAR_LR,
    }


# ---- parameter groups ----------------------------------------------------------------------------
def param_path(path) -> tuple:
    """('blocks', 0, 'attn', 'c_q', 'kernel') from a jax key path (nnx's trailing .value dropped)."""
    names = tuple(key_name(k) for k in path)
    return names[:-1] if names and names[-1] == "value" else names


def param_label(path: tuple, ndim: int) -> str:
    """The optimizer group of one parameter, by rule: every matrix in the blocks goes to Muon, the rest
    to the AdamW group named by its top-level attribute. An error names a parameter with no group."""
    if path and path[0] == "blocks" and ndim >= 2:
        return MUON_GROUP
    if path and path[0] in ADAMW_GROUP_OF:
        return ADAMW_GROUP_OF[path[0]]
    raise ValueError(
        f"parameter {'/'.join(map(str, path))} (ndim {ndim}) has no optimizer group: jaxchat.optim puts "
        f"matrices under 'blocks' in Muon and {', '.join(ADAMW_GROUP_OF)} in AdamW; add a rule for it there"
    )


class ParamLayout:
    """How the optimizer sees the parameters (its "view"):

        {"muon":  {"<in>x<out>": (n, in, out) every block matrix of that shape, stacked},
         "adamw": {<the parameter's path>: the parameter}}

    Each stack is padded with zero matrices to a multiple of `num_shards`, so that it splits over the
    devices by whole matrices; zero matrices stay zero through every Muon step. Optimizer state lives
    in this view, and so do gradients on their way into it (reduce-scattered straight into it)."""

    def __init__(self, params, num_shards: int = 1):
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.paths = [param_path(path) for path, _ in flat]
        self.shapes = [tuple(x.shape) for _, x in flat]
        self.labels = [param_label(path, len(shape)) for path, shape in zip(self.paths, self.shapes)]
        self.num_shards = num_shards
        self.groups: dict[str, list[int]] = {}
        for i, (label, shape) in enumerate(zip(self.labels, self.shapes)):
            if label == MUON_GROUP:  # a leading layer axis would count as that many matrices
                self.groups.setdefault("x".join(map(str, shape[-2:])), []).append(i)

    def _matrices(self, i: int) -> int:
        return math.prod(self.shapes[i][:-2])

    def stack_len(self, key: str) -> int:
        n = sum(self._matrices(i) for i in self.groups[key])
        return n + -n % self.num_shards

    def _adamw_items(self):
        return [(i, tuple(map(str, path))) for i, (path, label) in enumerate(zip(self.paths, self.labels))
                if label != MUON_GROUP]

    def _nest(self, values: dict[tuple, object]) -> dict:
        tree: dict = {}
        for path, value in values.items():
            node = tree
            for name in path[:-1]:
                node = node.setdefault(name, {})
            node[path[-1]] = value
        return tree

    def to_view(self, params) -> dict:
        leaves = self.treedef.flatten_up_to(params)
        muon = {}
        for key, members in self.groups.items():
            stack = jnp.concatenate([leaves[i].reshape(-1, *self.shapes[i][-2:]) for i in members])
            pad = self.stack_len(key) - stack.shape[0]
            muon[key] = jnp.pad(stack, [(0, pad), (0, 0), (0, 0)]) if pad else stack
        return {"muon": muon, "adamw": self._nest({path: leaves[i] for i, path in self._adamw_items()})}

    def from_view(self, view: dict):
        leaves = [None] * len(self.shapes)
        for key, members in self.groups.items():
            offset = 0
            for i in members:
                n = self._matrices(i)
                leaves[i] = view["muon"][key][offset:offset + n].reshape(self.shapes[i])
                offset += n
        for i, path in self._adamw_items():
            node = view["adamw"]
            for name in path:
                node = node[name]
            leaves[i] = node
        return self.treedef.unflatten(leaves)

    def view_of(self, per_param: list) -> dict:
        """A view-shaped tree from one value per view leaf: per_param[i] for AdamW parameter i, and
        per_param of the first member for each Muon stack."""
        return {"muon": {key: per_param[members[0]] for key, members in self.groups.items()},
                "adamw": self._nest({path: per_param[i] for i, path in self._adamw_items()})}

    def view_axes(self, param_axes: list[tuple]) -> dict:
        """Logical axis names of the view's leaves (a view-shaped tree of tuples) from those of the
        parameters (a list in leaf order): the parameters' own, and ('matrices', None, None) for stacks."""
        axes = self.view_of(param_axes)
        axes["muon"] = {key: ("matrices", None, None) for key in self.groups}
        return axes

    def view_labels(self) -> dict:
        return self.view_of(self.labels)


# ---- the optimizer -------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Optimizer:
    """nanochat's two optimizers as one optax transformation over the parameters' view (ParamLayout),
    with the schedules it trains with: what the log prints is what the update computes."""

    tx: optax.GradientTransformation  # over layout's view
    layout: ParamLayout
    learning_rates: dict[str, float]  # peak learning rate of each group
    lr_multiplier: Callable  # step -> multiplier of every group's learning rate
    muon_momentum: Callable  # step -> Muon's momentum
    weight_decay: Callable  # step -> Muon's (scaled, decaying) weight decay

    def init(self, params):
        return self.tx.init(self.layout.to_view(params))

    def update(self, grads, state, params):
        """As an optax transformation over the parameters themselves: (updates, new state). The train
        step works on the view directly, so that gradients arrive in it reduce-scattered."""
        updates, state = self.tx.update(self.layout.to_view(grads), state, self.layout.to_view(params))
        return self.layout.from_view(updates), state

    def schedules_at(self, steps) -> dict[str, np.ndarray]:
        """The values of the schedules at these steps (host arrays, for logging)."""
        steps = np.asarray(steps)
        return {"lrm": np.asarray(self.lr_multiplier(steps)), "muon_momentum": np.asarray(self.muon_momentum(steps)),
                "weight_decay": np.asarray(self.weight_decay(steps))}

    def state_axes(self, opt_state, param_axes: list[tuple]) -> list[tuple]:
        """Logical axes of every optimizer-state leaf (a list in leaf order): those of the view leaf it
        belongs to, found as the end of its path (mu, nu and momentum are view-shaped trees); none for
        step counts."""
        view_axes = {tuple(str(key_name(k)) for k in path): axes
                     for path, axes in jax.tree_util.tree_flatten_with_path(
                         self.layout.view_axes(param_axes), is_leaf=lambda x: isinstance(x, tuple))[0]}

        def axes_of(path, leaf):
            names = tuple(str(key_name(k)) for k in path)
            for start in range(len(names)):
                if names[start:] in view_axes:
                    return view_axes[names[start:]]
            return (None,) * len(leaf.shape)

        return [axes_of(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]]


def setup_optimizer(
    params,
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
) -> Optimizer:
    """nanochat's Muon + AdamW for the model's parameters (arrays or their shapes: every one must have a
    group, checked now). The keyword arguments are base_train.py's flags; the scaling rules and
    schedules are applied here. mesh: Muon's stacks split over its 'data' axis (nanochat's DistMuon).
    print_fn: prints the scaling rules and the groups (e.g. print0)."""
    if num_iterations <= 0:
        raise ValueError(f"num_iterations must be positive, got {num_iterations}")
    for name, value in (("unembedding_lr", unembedding_lr), ("embedding_lr", embedding_lr), ("matrix_lr", matrix_lr),
                        ("scalar_lr", scalar_lr), ("weight_decay", weight_decay)):
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    shards = mesh.shape[DATA_AXIS] if mesh is not None else 1
    layout = ParamLayout(params, shards)
    lrs = group_learning_rates(model_dim=model_dim, total_batch_size=total_batch_size, unembedding_lr=unembedding_lr,
                               embedding_lr=embedding_lr, matrix_lr=matrix_lr, scalar_lr=scalar_lr)
    wd = scaled_weight_decay(weight_decay, depth)
    if print_fn is not None:
        if total_batch_size != REFERENCE_BATCH_SIZE:
            print_fn(f"Scaling LRs by {batch_lr_scale(total_batch_size):.4f} for batch size {total_batch_size:,} "
                     f"(reference: {REFERENCE_BATCH_SIZE:,})")
        if depth != REFERENCE_DEPTH:
            print_fn(f"Scaling weight decay from {weight_decay:.6f} to {wd:.6f} for depth {depth}")
        print_fn(f"Scaling the LR for the AdamW parameters ∝1/√({model_dim}/{REFERENCE_MODEL_DIM}) = "
                 f"{(model_dim / REFERENCE_MODEL_DIM) ** -0.5:.6f}")
        for line in describe_param_groups(lrs, layout):
            print_fn(line)

    def lrm(step):
        return lr_multiplier(step, num_iterations, warmup_ratio, warmdown_ratio, final_lr_frac)

    def decay(step):
        return weight_decay_at(step, wd, num_iterations)

    def scheduled(peak_lr: float) -> Callable:
        return lambda count: peak_lr * lrm(count)

    b1, b2 = adam_betas
    # only the groups the model has: a bdcc030 model's optimizer state stays what it was
    transforms = {name: optax.adam(scheduled(lrs[name]), b1=b1, b2=b2, eps=ADAM_EPS) for name in ADAMW_GROUPS
                  if name in layout.labels}
    transforms[MUON_GROUP] = muon(learning_rate=scheduled(lrs[MUON_GROUP]), momentum=muon_momentum, weight_decay=decay)
    tx = optax.partition(transforms, layout.view_labels())
    return Optimizer(tx, layout, lrs, lrm, muon_momentum, decay)


def describe_param_groups(learning_rates: dict[str, float], layout: ParamLayout) -> list[str]:
    """One line per group: its peak lr, its tensors and elements, and Muon's stacks with their padding."""
    lines = []
    for name in (MUON_GROUP, *ADAMW_GROUPS):
        members = [i for i, label in enumerate(layout.labels) if label == name]
        if not members and name != MUON_GROUP:
            continue  # a group of the other recipe's parameters
        numel = sum(math.prod(layout.shapes[i]) for i in members)
        line = f"{name:>13}: lr {learning_rates[name]:<11.6g} | {len(members):3d} tensors, {numel:>13,} params"
        if name == MUON_GROUP:
            line += " | stacked " + ", ".join(f"{layout.stack_len(key)}x{key}" for key in layout.groups)
        lines.append(line)
    return lines
