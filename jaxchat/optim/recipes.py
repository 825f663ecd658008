"""The optimizer of base training: Muon for the block matrices, AdamW for everything else, as one
optax.partition, with the scaling rules and schedules of nanochat's scripts/base_train.py, per recipe
(OPTIMIZER_RECIPES): bdcc030's (nanochat/adamw.py, nanochat/muon.py) or 92d63d4's (nanochat/optim.py).

The schedules are pure functions of the step, written with jnp so they work on traced steps inside
the optimizer and on Python ints for printing. Each transform counts its own updates from 0, so the
update at step t uses exactly the values nanochat uses at step t.
"""

import dataclasses
import math
import types
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from jaxchat.common import compute_dtype as default_compute_dtype, key_name
from jaxchat.distributed.mesh import DATA_AXIS
from jaxchat.optim.muon import muon

REFERENCE_BATCH_SIZE = 2**19  # tokens; the learning rates were tuned at this batch size
REFERENCE_MODEL_DIM = 768  # the AdamW learning rates of wte and lm_head were tuned at this width
REFERENCE_DEPTH = 12  # weight decay (and, at 92d63d4, the batch size) was tuned at d12
MUON_MOMENTUM_WARMUP_STEPS = 300
ADAM_EPS = 1e-10
# nanochat 92d63d4 (scripts/base_train.py): the batch size follows the Power Lines paper, B ∝ D^0.383
# (arXiv 2505.13738), from 2^19 tokens at d12's horizon; Muon's momentum warms up over 400 steps to 0.97
# and falls to 0.90 across the LR warmdown
BATCH_SIZE_EXPONENT = 0.383
MOMENTUM_WARMUP_STEPS_92D63D4 = 400
MOMENTUM_START, MOMENTUM_PEAK_92D63D4, MOMENTUM_END_92D63D4 = 0.85, 0.97, 0.90

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


# ---- the optimizer of each recipe ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class AdamWGroup:
    """One AdamW group's own hyperparameters. betas None: the --adam-beta1/--adam-beta2 flags (bdcc030)."""

    betas: tuple[float, float] | None = None
    weight_decay: float = 0.0


@dataclasses.dataclass(frozen=True)
class OptimizerRecipe:
    """The optimizer of one nanochat commit: its AdamW groups, its Muon options and which of the schedules
    and scaling rules below it trains with. fp32_adamw: AdamW's moments and update in float32 whatever the
    parameter dtype (92d63d4's adamw_step_fused), as an optax.adamw otherwise (bdcc030: optax.adam)."""

    adamw: Mapping[str, AdamWGroup]
    muon: Mapping[str, object]  # keyword options of jaxchat.optim.muon.muon
    warmup: str  # 'ratio': round(warmup_ratio·N) steps; 'steps': warmup_steps
    momentum: str  # 'bdcc030' or '92d63d4': muon_momentum / muon_momentum_92d63d4
    weight_decay: str  # 'linear' or 'cosine' to zero at step N
    weight_decay_rule: str  # 'depth': ∝ 1/depth²; 'horizon': the T_epoch rule (scaled_weight_decay_92d63d4)
    fp32_adamw: bool
    # Polar Express's matmul operands in the compute dtype (92d63d4: bf16 only where the model computes in bf16,
    # float32 in a float32 run), else bf16 always (bdcc030's nanochat/muon.py: `X = G.bfloat16()`)
    polar_in_compute_dtype: bool


OPTIMIZER_RECIPES: Mapping[str, OptimizerRecipe] = types.MappingProxyType({
    # nanochat/adamw.py + nanochat/muon.py at bdcc030: every AdamW group with the flags' betas, no decay
    "bdcc030": OptimizerRecipe(
        adamw=types.MappingProxyType({name: AdamWGroup()
                                      for name in ("wte", "lm_head", "resid_lambdas", "x0_lambdas")}),
        muon=types.MappingProxyType({"beta2": 0.95}), warmup="ratio", momentum="bdcc030", weight_decay="linear",
        weight_decay_rule="depth", fp32_adamw=False, polar_in_compute_dtype=False),
    # nanochat/optim.py and GPT.setup_optimizer at 92d63d4
    "92d63d4": OptimizerRecipe(
        adamw=types.MappingProxyType({
            "lm_head": AdamWGroup((0.8, 0.96), 0.01),
            "wte": AdamWGroup((0.8, 0.995), 0.001),
            "value_embeds": AdamWGroup((0.8, 0.995), 0.01),
            "resid_lambdas": AdamWGroup((0.8, 0.95), 0.05),
            "x0_lambdas": AdamWGroup((0.96, 0.95), 0.0),
            "smear": AdamWGroup((0.8, 0.95), 0.0),
        }),
        muon=types.MappingProxyType({"beta2": 0.9, "norm_safety": 1.01, "row_equilibration": True,
                                     "renormalize": True}),
        warmup="steps", momentum="92d63d4", weight_decay="cosine", weight_decay_rule="horizon", fp32_adamw=True,
        polar_in_compute_dtype=True),
})


def optimizer_recipe(name: str) -> OptimizerRecipe:
    if name not in OPTIMIZER_RECIPES:
        raise ValueError(f"no optimizer for recipe {name!r}: use one of {', '.join(OPTIMIZER_RECIPES)}")
    return OPTIMIZER_RECIPES[name]


# ---- schedules -----------------------------------------------------------------------------------
def lr_multiplier(step, num_iterations: int, warmup_iters: int, warmdown_ratio: float, final_lr_frac: float):
    """Linear warmup over warmup_iters steps (bdcc030: round(warmup_ratio·N); 92d63d4: --warmup-steps),
    1.0, then linear warmdown over the last round(warmdown_ratio·N) steps to final_lr_frac (reached at
    step N)."""
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


def muon_momentum_92d63d4(step, num_iterations: int, warmdown_ratio: float):
    """0.85 -> 0.97 linearly over the first 400 steps, 0.97, then 0.97 -> 0.90 linearly across the LR
    warmdown (from step N - round(warmdown_ratio·N) to N); the warmup wins where they overlap."""
    warmdown_iters = round(warmdown_ratio * num_iterations)
    warmdown_start = num_iterations - warmdown_iters
    it = jnp.asarray(step, jnp.float32)
    frac = it / MOMENTUM_WARMUP_STEPS_92D63D4
    warmup = (1 - frac) * MOMENTUM_START + frac * MOMENTUM_PEAK_92D63D4
    progress = (it - warmdown_start) / max(warmdown_iters, 1)
    warmdown = MOMENTUM_PEAK_92D63D4 * (1 - progress) + MOMENTUM_END_92D63D4 * progress
    return jnp.where(it < MOMENTUM_WARMUP_STEPS_92D63D4, warmup,
                     jnp.where(it >= warmdown_start, warmdown, MOMENTUM_PEAK_92D63D4))


def weight_decay_cosine(step, weight_decay_scaled: float, num_iterations: int):
    """Muon's weight decay at 92d63d4: wd·(1 + cos(π·step/N))/2, from wd to zero at step N."""
    return weight_decay_scaled * 0.5 * (1 + jnp.cos(jnp.pi * jnp.asarray(step, jnp.float32) / num_iterations))


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


def auto_total_batch_size(target_tokens: int, reference_tokens: float) -> int:
    """92d63d4's --total-batch-size -1: 2^19 x (D / D_ref)^0.383 to the nearest power of two, D the run's
    target tokens and D_ref those of d12 at the same data:param ratio."""
    predicted = REFERENCE_BATCH_SIZE * (target_tokens / reference_tokens) ** BATCH_SIZE_EXPONENT
    return 2 ** round(math.log2(predicted))


def scaled_weight_decay_92d63d4(weight_decay: float, total_batch_size: int, target_tokens: int,
                                reference_tokens: float) -> float:
    """T_epoch = B/(η·λ·D) held constant (arXiv 2405.13698) with η ∝ √(B/B_ref):
    λ = λ_ref · √(B/B_ref) · D_ref/D (nanochat scripts/base_train.py at 92d63d4)."""
    return weight_decay * math.sqrt(total_batch_size / REFERENCE_BATCH_SIZE) * (reference_tokens / target_tokens)


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
        f"parameter {'/'.join(map(str, path))} (ndim {ndim}) has no optimizer group: jaxchat.optim.recipes puts "
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
        """The values of the schedules at these steps (host arrays, for logging), computed by one jitted program
        as the step computes them (op by op, each jnp operation would compile its own: 0.45 s a run, not 0.08 s)."""
        values = jax.jit(lambda s: {"lrm": self.lr_multiplier(s), "muon_momentum": self.muon_momentum(s),
                                    "weight_decay": self.weight_decay(s)})(np.asarray(steps))
        return jax.tree.map(np.asarray, values)

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


def adamw_fp32(learning_rate: Callable, b1: float, b2: float, eps: float, weight_decay: float
               ) -> optax.GradientTransformation:
    """nanochat 92d63d4's adamw_step_fused: decoupled decay p·(1 − lr·wd) then Adam, its moments and
    arithmetic in float32 whatever the parameter dtype (bf16 embeddings). optax.apply_updates adds the
    float32 update to the parameter in float32 and rounds the sum once, as nanochat's p.copy_(p32)."""
    f32 = jnp.float32

    def init_fn(params):
        zeros = lambda p: jnp.zeros(p.shape, f32)  # noqa: E731
        return optax.ScaleByAdamState(count=jnp.zeros((), jnp.int32), mu=jax.tree.map(zeros, params),
                                      nu=jax.tree.map(zeros, params))

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError("adamw_fp32 needs the params for its weight decay: call update(grads, state, params)")
        count = optax.safe_int32_increment(state.count)
        lr = learning_rate(state.count).astype(f32)
        t = count.astype(f32)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(f32), state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(f32)), state.nu, grads)
        bias1, bias2 = 1 - b1**t, 1 - b2**t

        def update(p, m, v):
            p32 = p.astype(f32)
            new = p32 * (1 - lr * weight_decay) - (lr / bias1) * m / (jnp.sqrt(v / bias2) + eps)
            return new - p32

        return jax.tree.map(update, params, mu, nu), optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class Horizon:
    """92d63d4's weight-decay rule needs the run's horizon: its target tokens D and d12's D_ref."""

    target_tokens: int
    reference_tokens: float


def _scaled_weight_decay(spec: OptimizerRecipe, weight_decay: float, depth: int, total_batch_size: int,
                         horizon: Horizon | None) -> float:
    if spec.weight_decay_rule == "depth":
        return scaled_weight_decay(weight_decay, depth)
    if horizon is None:
        raise ValueError("this recipe scales weight decay by the horizon: setup_optimizer needs horizon=Horizon(...)")
    return scaled_weight_decay_92d63d4(weight_decay, total_batch_size, horizon.target_tokens, horizon.reference_tokens)


def _schedules(spec: OptimizerRecipe, num_iterations: int, wd: float, warmup_ratio: float, warmup_steps: int,
               warmdown_ratio: float, final_lr_frac: float) -> tuple[Callable, Callable, Callable]:
    """(lr multiplier, Muon momentum, Muon weight decay) of the recipe, each a function of the step."""
    warmup_iters = round(warmup_ratio * num_iterations) if spec.warmup == "ratio" else warmup_steps
    decay_rule = weight_decay_cosine if spec.weight_decay == "cosine" else weight_decay_at

    def lrm(step):
        return lr_multiplier(step, num_iterations, warmup_iters, warmdown_ratio, final_lr_frac)

    def momentum(step):
        if spec.momentum == "92d63d4":
            return muon_momentum_92d63d4(step, num_iterations, warmdown_ratio)
        return muon_momentum(step)

    def decay(step):
        return decay_rule(step, wd, num_iterations)

    return lrm, momentum, decay


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
    warmup_steps: int = 0,
    warmdown_ratio: float = 0.4,
    final_lr_frac: float = 0.0,
    recipe: str = "bdcc030",
    horizon: Horizon | None = None,
    mesh: Mesh | None = None,
    print_fn: Callable[[str], None] | None = None,
    compute_dtype=None,
) -> Optimizer:
    """nanochat's Muon + AdamW for the model's parameters (arrays or their shapes: every one must have a
    group, checked now). The keyword arguments are base_train.py's flags; the scaling rules and
    schedules are the recipe's (OPTIMIZER_RECIPES), applied here: adam_betas and warmup_ratio are
    bdcc030's, warmup_steps and horizon 92d63d4's. mesh: Muon's stacks split over its 'data' axis
    (nanochat's DistMuon). print_fn: prints the scaling rules and the groups (e.g. print0). compute_dtype: the
    model's (default: this platform's), for the recipes whose Polar Express follows it."""
    spec = optimizer_recipe(recipe)
    if num_iterations <= 0:
        raise ValueError(f"num_iterations must be positive, got {num_iterations}")
    for name, value in (("unembedding_lr", unembedding_lr), ("embedding_lr", embedding_lr), ("matrix_lr", matrix_lr),
                        ("scalar_lr", scalar_lr), ("weight_decay", weight_decay), ("warmup_steps", warmup_steps)):
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    shards = mesh.shape[DATA_AXIS] if mesh is not None else 1
    layout = ParamLayout(params, shards)
    lrs = group_learning_rates(model_dim=model_dim, total_batch_size=total_batch_size, unembedding_lr=unembedding_lr,
                               embedding_lr=embedding_lr, matrix_lr=matrix_lr, scalar_lr=scalar_lr)
    wd = _scaled_weight_decay(spec, weight_decay, depth, total_batch_size, horizon)
    if print_fn is not None:
        if total_batch_size != REFERENCE_BATCH_SIZE:
            print_fn(f"Scaling LRs by {batch_lr_scale(total_batch_size):.4f} for batch size {total_batch_size:,} "
                     f"(reference: {REFERENCE_BATCH_SIZE:,})")
        if wd != weight_decay:
            print_fn(f"Scaling weight decay from {weight_decay:.6f} to {wd:.6f} for depth {depth}")
        print_fn(f"Scaling the LR for the AdamW parameters ∝1/√({model_dim}/{REFERENCE_MODEL_DIM}) = "
                 f"{(model_dim / REFERENCE_MODEL_DIM) ** -0.5:.6f}")
        for line in describe_param_groups(lrs, layout):
            print_fn(line)
    lrm, momentum, decay = _schedules(spec, num_iterations, wd, warmup_ratio, warmup_steps, warmdown_ratio,
                                      final_lr_frac)

    def scheduled(peak_lr: float) -> Callable:
        return lambda count: peak_lr * lrm(count)

    transforms = {}
    for name in dict.fromkeys(layout.labels):  # only the groups the model has
        if name == MUON_GROUP:
            continue
        if name not in spec.adamw:
            raise ValueError(f"recipe {recipe} has no AdamW group {name!r}: the model is of another recipe")
        group = spec.adamw[name]
        b1, b2 = group.betas or adam_betas
        transforms[name] = (adamw_fp32(scheduled(lrs[name]), b1, b2, ADAM_EPS, group.weight_decay) if spec.fp32_adamw
                            else optax.adam(scheduled(lrs[name]), b1=b1, b2=b2, eps=ADAM_EPS))
    polar_dtype = jnp.dtype(compute_dtype or default_compute_dtype()) if spec.polar_in_compute_dtype else jnp.bfloat16
    transforms[MUON_GROUP] = muon(learning_rate=scheduled(lrs[MUON_GROUP]), momentum=momentum, weight_decay=decay,
                                  polar_dtype=polar_dtype, **spec.muon)
    tx = optax.partition(transforms, layout.view_labels())
    return Optimizer(tx, layout, lrs, lrm, momentum, decay)


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
