"""Muon for the matrices of the transformer blocks, as one optax GradientTransformation.

nanochat's Muon (nanochat/muon.py), for every matrix of a pytree:
1. Nesterov momentum: m = β·m + (1−β)·g; u = (1−β)·g + β·m
2. Polar Express: u is replaced by (roughly) its orthogonal polar factor U·Vᵀ, with bfloat16 matmuls
   (options of nanochat/optim.py at 92d63d4: MuonEq row equilibration before it, normalisation 1.01
   instead of 1.02, and Muon+ after it: the Frobenius norm rescaled to √min(m, n))
3. NorMuon variance reduction: a factored second moment of the orthogonalised update rescales
   each output neuron (or each input, for matrices with more inputs than outputs)
4. cautious weight decay: p −= lr_eff·X + lr_eff·wd·p·[X·p ≥ 0], lr_eff = lr·max(1, out/in)^0.5

Layout. nanochat states the rules on PyTorch weights, (rows, cols) = (out, in). Flax kernels are the
transpose, (in, out): here axis −2 is the input (PyTorch's cols) and axis −1 the output (PyTorch's
rows). Every rule below is written for kernels; the comments give the PyTorch rule it translates.
Any leading axes (a stacked layer axis) are batch axes: each slice is its own matrix.

jaxchat.optim.recipes hands Muon same-shape matrices stacked into one array per shape, split over the devices
by whole matrices (nanochat's DistMuon): each device orthogonalises only its share, with no
communication inside the update.
"""

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

# Polar Express (Amsel et al. 2025, arXiv 2505.16932) for 5 iterations, safety factor 2e-2, cushion 2:
# (a, b, c) of the odd polynomial a·x + b·x³ + c·x⁵ applied to the singular values at each step.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Normalising by 1.02·‖X‖_F keeps the largest singular value safely below 1 despite bf16 rounding
# (nanochat/muon.py at bdcc030; nanochat/optim.py at 92d63d4 uses 1.01).
NORM_SAFETY = 1.02
SECOND_MOMENT_FLOOR = 1e-10
NORM_FLOOR = 1e-6  # MuonEq's row norms and Muon+'s Frobenius norm are clamped here (nanochat/optim.py, 92d63d4)

Hyperparameter = float | Callable[[jax.Array], jax.Array]


def polar_express(x: jax.Array, ns_steps: int = 5, dtype=jnp.bfloat16, *, norm_safety: float = NORM_SAFETY,
                  row_equilibration: bool = False, unroll: bool | None = None) -> jax.Array:
    """Approximate orthogonal polar factor of each matrix of x (..., r, c), returned in float32.

    dtype is that of the matmul operands: bfloat16 as nanochat, or float32 for the exact polynomial
    (e.g. to test against). The matmuls accumulate and return float32; everything else (the
    normalisation, the coefficients, the sums) is float32 arithmetic, and values are rounded to
    dtype only where they become matmul operands. nanochat (nanochat/muon.py) rounds at those points
    too, but also rounds every product, sum and the result to bf16; rounding less, this is the more
    accurate (on Gaussian matrices its error against the exact polynomial is 0.3-0.45x nanochat's,
    which tests/test_muon.py emulates).

    The iteration X <- a·X + (b·A + c·A²)·X with A = X·Xᵀ is an odd polynomial in X, so it commutes
    with transposition: unrolled (GPUs, TPUs), a tall matrix's small Gram Xᵀ·X is formed and multiplied from
    the right, nanochat's "work on the transpose" without materialising one; on the CPU the transpose itself
    is carried (in_a_loop below).

    norm_safety: X is first divided by norm_safety·‖X‖_F. row_equilibration: MuonEq (row_equilibrate) on
    the rounded input before that, as nanochat/optim.py at 92d63d4. unroll: the steps unrolled (True) or as a
    loop (False); None, the default: a loop on the CPU, unrolled elsewhere (why: in_a_loop below).
    """
    if not 1 <= ns_steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"ns_steps must be in 1..{len(POLAR_EXPRESS_COEFFS)}, got {ns_steps}")
    f32 = jnp.float32
    finfo = jnp.finfo(dtype)

    def rounded(v: jax.Array) -> jax.Array:
        # v rounded to dtype's precision, kept float32. reduce_precision, not a cast down and back up:
        # XLA may drop a f32 -> bf16 -> f32 pair of casts (SimplifyFPConversions, on GPU by default).
        return jax.lax.reduce_precision(v, finfo.nexp, finfo.nmant)

    def matmul(p: jax.Array, q: jax.Array) -> jax.Array:
        return jnp.matmul(p.astype(dtype), q.astype(dtype), preferred_element_type=f32)

    # the input rounded first, as nanochat's g.bfloat16(): an ulp of float32 difference in it (the
    # momentum fused differently by another program, e.g. the sharded one) then almost never reaches
    # the result, where it could otherwise flip a rounding and cascade through the iteration
    x = rounded(x.astype(f32))
    if row_equilibration:
        x = row_equilibrate(x)
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True))
    x = x / (norm * norm_safety + 1e-6)
    tall = x.shape[-2] > x.shape[-1]

    def iteration(x: jax.Array, abc) -> jax.Array:
        # X and A are rounded once each and every term uses the rounded values: the step is then the
        # exact polynomial of one nearby matrix, an error the later steps contract (a float32 X or A
        # in one term would add the mismatch times a coefficient, |b| up to 22). a, b, c multiply
        # float32 arrays, so they are never rounded (times a bf16 array, a Python float is rounded
        # to bf16 first: 8.1566 -> 8.1875).
        a, b, c = abc
        tall = x.shape[-2] > x.shape[-1]  # (False for the wide transpose in_a_loop carries)
        x = rounded(x)
        a_gram = rounded(gram(x, dtype))  # (c, c) or (r, r)
        poly = b * a_gram + c * matmul(a_gram, a_gram)
        return a * x + (matmul(x, poly) if tall else matmul(poly, x))

    def unrolled(x: jax.Array) -> jax.Array:
        for abc in POLAR_EXPRESS_COEFFS[:ns_steps]:
            x = iteration(x, abc)
        return x

    def in_a_loop(x: jax.Array) -> jax.Array:
        # on the CPU, a loop whose carry is the one X each step starts from: unrolled, XLA:CPU fused each step's
        # elementwise update into the next step's consumers and recomputed every earlier step's from the input
        # in each (O(steps^2) passes over the stack; d4's Polar Express 108 -> 87 ms, the same bits). Not on
        # GPUs: there the loop made the d20 step compiled for 8 H100s peak at 57.1 GiB per device, not 36.7.
        # A tall X is carried as its wide transpose (nanochat's "work on the transpose"): its Gram Xᵀ·X, a
        # contraction over the first axis of both operands, ran in Eigen on float32 copies; X·Xᵀ of the
        # transpose runs in YNNPACK's bf16 kernel (d4's tall stack 30 -> 20 ms)
        coeffs = jnp.asarray(POLAR_EXPRESS_COEFFS[:ns_steps], f32)
        wide = jax.lax.scan(lambda x, abc: (iteration(x, abc), None), jnp.swapaxes(x, -1, -2) if tall else x, coeffs)[0]
        return jnp.swapaxes(wide, -1, -2) if tall else wide

    if unroll is None:  # chosen where the program is lowered: a GPU program compiled on a CPU host is unrolled
        return jax.lax.platform_dependent(x, cpu=in_a_loop, default=unrolled)
    return unrolled(x) if unroll else in_a_loop(x)


def gram(x: jax.Array, dtype) -> jax.Array:
    """Xᵀ·X of each tall matrix of x, X·Xᵀ of the others, from its operands rounded to dtype, in float32: one dot
    of the single operand with itself, contracting the long axis. (Written as matmul(x, x.mT), XLA:CPU fused the
    second operand's cast into the dot and ran it on float32 inputs at ~100 GFLOP/s, not YNNPACK's bf16 kernel:
    d4's Polar Express 124 -> 98 ms.)"""
    operand = x.astype(dtype)
    long_axis = x.ndim - (2 if x.shape[-2] > x.shape[-1] else 1)
    batch = tuple(range(x.ndim - 2))
    return jax.lax.dot_general(operand, operand, (((long_axis,), (long_axis,)), (batch, batch)),
                               preferred_element_type=jnp.float32)


def row_equilibrate(x: jax.Array) -> jax.Array:
    """MuonEq (arXiv 2603.28254, nanochat/optim.py at 92d63d4), float32, on kernels x (..., in, out): every
    PyTorch row (an output: a column of the kernel, norm over axis -2) rescaled to the root mean square
    row norm ‖X‖_F/√rows, so that the spectrum Polar Express starts from is better conditioned."""
    target = jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) / math.sqrt(x.shape[-1])
    row_norm = jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=-2, keepdims=True)), NORM_FLOOR)
    return x * (target / row_norm)


def muon_plus(x: jax.Array) -> jax.Array:
    """Muon+ (arXiv 2602.21545, nanochat/optim.py at 92d63d4): each matrix's Frobenius norm snapped to
    √min(m, n), that of an exactly semi-orthogonal matrix, correcting Polar Express's under-convergence."""
    norm = jnp.maximum(jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)), NORM_FLOOR)
    return x * (math.sqrt(min(x.shape[-2:])) / norm)


def polar_express_flops(shapes: Iterable[tuple[int, ...]], ns_steps: int = 5) -> int:
    """Matmul FLOPs of Polar Express over matrices of these shapes (leading axes count as matrices).

    Per iteration on an m x n matrix, m <= n: the Gram (2·m²·n), its square (2·m³) and B·X (2·m²·n);
    the elementwise terms add about 1% at model sizes (XLA's cost_analysis agrees).
    """
    total = 0
    for shape in shapes:
        m, n = sorted(shape[-2:])
        total += math.prod(shape[:-2]) * ns_steps * (4 * m * m * n + 2 * m**3)
    return total


def reduce_axis(shape: tuple[int, ...]) -> int:
    """Axis of a kernel (..., in, out) that the factored second moment averages over.

    PyTorch: over the last axis (in) when rows >= cols (out >= in), else over the rows (out).
    Kernels: over axis -2 (in) when out >= in, keeping one statistic per output; else over -1.
    """
    return -2 if shape[-1] >= shape[-2] else -1


def second_moment_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """(..., 1, out) or (..., in, 1): PyTorch's (rows, 1) or (1, cols), transposed."""
    factored = list(shape)
    factored[reduce_axis(shape)] = 1
    return tuple(factored)


def lr_aspect_factor(shape: tuple[int, ...]) -> float:
    """max(1, rows/cols)^0.5 in PyTorch terms = max(1, out/in)^0.5: larger steps for expanding matrices."""
    return max(1.0, shape[-1] / shape[-2]) ** 0.5


class MuonState(NamedTuple):
    count: jax.Array  # int32: updates done so far; the schedules are evaluated at it
    momentum: optax.Updates  # like the params: same shapes and dtypes
    second_moment: optax.Updates  # float32, factored: second_moment_shape(param.shape)


def variance_reduction(x: jax.Array, second_moment: jax.Array, beta2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """NorMuon step (nanochat/muon.py), float32, on kernels x (..., in, out): rescale the slices along
    reduce_axis by rsqrt of their running mean square, then restore x's total norm."""
    axis = reduce_axis(x.shape)
    n = x.shape[axis]
    v = jnp.mean(jnp.square(x), axis=axis, keepdims=True)
    norm = jnp.sqrt(jnp.sum(v, axis=(-2, -1), keepdims=True) * n)
    second_moment = beta2 * second_moment + (1 - beta2) * v
    step = jax.lax.rsqrt(jnp.maximum(second_moment, SECOND_MOMENT_FLOOR))
    norm_new = jnp.sqrt(jnp.sum(v * n * jnp.square(step), axis=(-2, -1), keepdims=True))
    return x * step * (norm / jnp.maximum(norm_new, SECOND_MOMENT_FLOOR)), second_moment


def _value_at(hyperparameter: Hyperparameter, count: jax.Array) -> jax.Array:
    value = hyperparameter(count) if callable(hyperparameter) else hyperparameter
    return jnp.asarray(value, jnp.float32)


def muon(
    learning_rate: Hyperparameter,
    momentum: Hyperparameter = 0.95,
    ns_steps: int = 5,
    beta2: float = 0.95,
    weight_decay: Hyperparameter = 0.0,
    polar_dtype=jnp.bfloat16,
    *,
    norm_safety: float = NORM_SAFETY,
    row_equilibration: bool = False,
    renormalize: bool = False,
) -> optax.GradientTransformation:
    """nanochat's Muon for a pytree of kernels (..., in, out), each with ndim >= 2; leading axes are
    batch axes (a stack of same-shape matrices is orthogonalised by one batched matmul chain).

    learning_rate, momentum and weight_decay are floats or schedules (functions of the update count,
    held in the state), so they change per step inside one compiled update. update() needs params
    (cautious weight decay); optax.apply_updates then gives p - lr_eff·X - lr_eff·wd·p·mask.
    polar_dtype: dtype of the Polar Express matmul operands: bfloat16 as nanochat at bdcc030; the model's compute
    dtype at 92d63d4 (jaxchat.optim.recipes.OptimizerRecipe.polar_in_compute_dtype).
    norm_safety, row_equilibration (MuonEq), renormalize (Muon+): nanochat 92d63d4's options (1.01, True,
    True there); the defaults are bdcc030's Muon, unchanged.
    Sharding follows the inputs: stacks split over a mesh axis by whole matrices are updated locally.
    """

    def init_fn(params):
        def check(path, p):
            if p.ndim < 2:
                raise ValueError(
                    f"muon handles matrices only: {jax.tree_util.keystr(path)} has shape {p.shape}; give it to AdamW"
                )

        jax.tree_util.tree_map_with_path(check, params)
        return MuonState(
            count=jnp.zeros((), jnp.int32),
            momentum=jax.tree.map(jnp.zeros_like, params),
            second_moment=jax.tree.map(lambda p: jnp.zeros(second_moment_shape(p.shape), jnp.float32), params),
        )

    def update_fn(grads, state, params=None):
        if params is None:
            raise ValueError("muon needs the params for its cautious weight decay: call update(grads, state, params)")
        lr = _value_at(learning_rate, state.count)
        beta = _value_at(momentum, state.count)
        wd = _value_at(weight_decay, state.count)
        g_leaves, treedef = jax.tree.flatten(grads)
        p_leaves = treedef.flatten_up_to(params)
        m_leaves = treedef.flatten_up_to(state.momentum)
        s_leaves = treedef.flatten_up_to(state.second_moment)

        # 1. Nesterov momentum, elementwise per matrix
        new_m = [(beta * m + (1 - beta) * g).astype(m.dtype) for g, m in zip(g_leaves, m_leaves)]
        directions = [(1 - beta) * g + beta * m for g, m in zip(g_leaves, new_m)]
        # 2-3. orthogonalise and variance-reduce each stack of matrices. Deliberately unlike nanochat, all
        # but the Polar Express matmul operands is float32 from here on: nanochat keeps the update in
        # bf16 and rounds beta2, the variance-reduction scale, lr and wd to bf16 before using them
        # (beta2 0.95 -> 0.9492, lr 0.02 -> 0.02002): ~0.4% rounding noise in every step and fixed
        # offsets in its hyperparameters, none of which this has.
        xs, new_s = [], []
        for u, s in zip(directions, s_leaves):
            x = polar_express(u, ns_steps, polar_dtype, norm_safety=norm_safety, row_equilibration=row_equilibration)
            x, s = variance_reduction(muon_plus(x) if renormalize else x, s, jnp.float32(beta2))
            xs.append(x)
            new_s.append(s)
        # 4. cautious weight decay: decay only where the update and the weight agree in sign
        updates = []
        for x, p in zip(xs, p_leaves):
            lr_eff = lr * lr_aspect_factor(p.shape)
            decay = jnp.where(x * p >= 0, p, 0).astype(jnp.float32)
            updates.append((-(lr_eff * x + lr_eff * wd * decay)).astype(p.dtype))
        new_state = MuonState(
            count=optax.safe_int32_increment(state.count),
            momentum=treedef.unflatten(new_m),
            second_moment=treedef.unflatten(new_s),
        )
        return treedef.unflatten(updates), new_state

    return optax.GradientTransformation(init_fn, update_fn)
