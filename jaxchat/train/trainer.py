"""The train state and the jitted train step.

One optimizer step is one dispatch: a jax.jit over (params, opt_state, inputs, targets) that scans
over the micro-batches (gradient accumulation with lax.scan), averages the gradients and applies the
optimizer. Shardings are explicit on the way in and out, and the state buffers are donated, so XLA
updates them in place. Nothing here reads a value back to the host.

Communication per step, data parallel with ZeRO-1 (the default), as nanochat's DDP + DistMuon/DistAdamW:
- forward and backward run per device on its rows (a shard_map), gradients accumulate locally over
  the micro-batches;
- once per step they are reduce-scattered straight into the optimizer's view (jaxchat.optim.recipes.ParamLayout):
  each device receives the summed gradient of its rows of wte and lm_head and of its whole Muon matrices;
- each device updates its share; the new parameters are all-gathered.
With --fsdp the parameters are sharded too and XLA's partitioner places the collectives (it gathers
each layer's weights where they are used).
"""

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxchat.common import per_process_cache
from jaxchat.model.gpt import GPT, GPTConfig, abstract_model, logical_axes, use_fp8  # abstract_model: re-exported
from jaxchat.distributed.mesh import DATA_AXIS, REPLICATED, SHARDED, batch_sharding, rows_partitioned, shardings
from jaxchat.optim.recipes import Optimizer


@dataclass
class TrainState:
    """Everything the step updates, plus the static structure needed to rebuild the model."""

    graphdef: Any  # nnx.GraphDef of the GPT: static, not part of the jitted state
    params: Any  # nnx.State of the parameters
    opt_state: Any  # optax state over the optimizer's view (includes the step counts the schedules read)
    param_shardings: Any
    opt_shardings: Any
    fsdp: bool = False

    def model(self) -> GPT:
        """A GPT holding the current parameters (shares their buffers; for eval and sampling), with fp8
        matmuls off: evaluation and sampling run in the compute dtype, as nanochat's (disable_fp8)."""
        model = nnx.merge(self.graphdef, self.params)
        use_fp8(model, False)
        return model


def abstract_train_state(config: GPTConfig, optimizer: Optimizer, mesh: Mesh, *,
                         fsdp: bool = False, seed: int = 0, **model_kwargs) -> TrainState:
    """The train state's shapes and shardings, with ShapeDtypeStructs for arrays: what a checkpoint
    is restored into, and what init_train_state fills."""
    graphdef, abstract_params = nnx.split(abstract_model(config, seed, **model_kwargs))
    axes = logical_axes(abstract_params)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    o_shardings = shardings(abstract_opt_state, optimizer.state_axes(abstract_opt_state, axes), SHARDED, mesh)
    return TrainState(graphdef, abstract_params, abstract_opt_state, _param_shardings(abstract_params, mesh, fsdp),
                      o_shardings, fsdp)


def _param_shardings(abstract_params, mesh: Mesh, fsdp: bool):
    return shardings(abstract_params, logical_axes(abstract_params), SHARDED if fsdp else REPLICATED, mesh)


def init_train_state(config: GPTConfig, optimizer: Optimizer, mesh: Mesh, *,
                     fsdp: bool = False, seed: int = 0, **model_kwargs) -> TrainState:
    """Initialise parameters and optimizer state directly into their shardings on the mesh, so no
    device ever holds a full copy it should not (eval_shape, then a jitted init with out_shardings)."""
    state = abstract_train_state(config, optimizer, mesh, fsdp=fsdp, seed=seed, **model_kwargs)
    state.params = _jitted_init_params(config, seed, mesh, fsdp, **model_kwargs)()
    state.opt_state = jax.jit(optimizer.init, out_shardings=state.opt_shardings)(state.params)
    return state


@per_process_cache
def _jitted_init_params(config: GPTConfig, seed: int, mesh: Mesh, fsdp: bool, **model_kwargs) -> Callable:
    """The parameters' initialiser, jitted into their shardings, kept per process: a process that initialises
    the same model again (the tests' runs in one process) neither traces nor compiles it again (0.5-0.7 s at
    d2-d4)."""
    abstract_params = nnx.state(abstract_model(config, seed, **model_kwargs))

    def init_params():
        return nnx.state(GPT(config, rngs=nnx.Rngs(seed), **model_kwargs))

    return jax.jit(init_params, out_shardings=_param_shardings(abstract_params, mesh, fsdp))


def view_shardings(state: TrainState, optimizer: Optimizer, mesh: Mesh):
    """Where the optimizer's view of the parameters (and so the gradients entering it) lives: ZeRO-1."""
    abstract_view = jax.eval_shape(optimizer.layout.to_view, state.params)
    axes = jax.tree.leaves(optimizer.layout.view_axes(logical_axes(state.params)), is_leaf=lambda x: isinstance(x, tuple))
    return shardings(abstract_view, axes, SHARDED, mesh)


def _scatter_dim(spec: P) -> int | None:
    return list(spec).index(DATA_AXIS) if DATA_AXIS in spec else None


def _reduce_scatter(x: jax.Array, spec: P, reduce_scatter: bool = True) -> jax.Array:
    """Inside shard_map: sum over the devices, each keeping the slice its spec gives it. With
    reduce_scatter=False as an all-reduce and a slice (twice the bytes; see make_train_step)."""
    dim = _scatter_dim(spec)
    if dim is None or not reduce_scatter:
        return _own_slice(jax.lax.psum(x, DATA_AXIS), spec)
    return jax.lax.psum_scatter(x, DATA_AXIS, scatter_dimension=dim, tiled=True)


def _own_slice(x: jax.Array, spec: P) -> jax.Array:
    """Inside shard_map: this device's slice of a replicated array (no communication)."""
    dim = _scatter_dim(spec)
    if dim is None:
        return x
    size = x.shape[dim] // jax.lax.axis_size(DATA_AXIS)
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(DATA_AXIS) * size, size, axis=dim)


def _all_gather(x: jax.Array, spec: P) -> jax.Array:
    dim = _scatter_dim(spec)
    return x if dim is None else jax.lax.all_gather(x, DATA_AXIS, axis=dim, tiled=True)


def make_train_step(state: TrainState, optimizer: Optimizer, mesh: Mesh) -> Callable:
    """Returns step(params, opt_state, inputs, targets) -> (params, opt_state, metrics).

    inputs/targets: (grad_accum, batch, T) int32, batch rows sharded over the mesh. Each micro-batch's
    loss is the mean over its tokens, and gradients are averaged over micro-batches and devices
    (nanochat's DDP), so k micro-batches of B rows equal one batch of k*B rows. metrics['loss'] is the
    mean micro-batch loss (a device scalar)."""
    graphdef, layout, tx = state.graphdef, optimizer.layout, optimizer.tx
    view_out = view_shardings(state, optimizer, mesh)
    view_specs = jax.tree.map(lambda s: s.spec, view_out)
    # XLA:CPU's reduce-scatter across processes (gloo) is not reproducible from run to run (seen with
    # JAX 0.10.2; an all-reduce is), which would break exact resume of a multi-process CPU run: there
    # the gradients are all-reduced instead. GPUs (NCCL) and single-process runs reduce-scatter.
    reduce_scatter = not (mesh.devices.flat[0].platform == "cpu" and jax.process_count() > 1)

    def accumulate(params, inputs, targets):
        def micro_step(grad_sum, batch):
            loss, grads = jax.value_and_grad(lambda p, x, y: nnx.merge(graphdef, p)(x, y))(params, *batch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            if state.fsdp:  # reduce-scatter each micro-batch's gradients onto the parameters' shards
                grad_sum = jax.lax.with_sharding_constraint(grad_sum, state.param_shardings)
            return grad_sum, loss

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        grad_sum, losses = jax.lax.scan(micro_step, zeros, (inputs, targets))
        return grad_sum, jnp.mean(losses)

    def zero1_step(params, opt_state, inputs, targets):
        """Per device (shard_map): its rows, the whole parameters, its share of the optimizer state."""
        grad_sum, loss = accumulate(params, inputs, targets)
        scale = 1.0 / (inputs.shape[0] * jax.lax.axis_size(DATA_AXIS))
        grads = jax.tree.map(lambda g, spec: _reduce_scatter(g * scale, spec, reduce_scatter), layout.to_view(grad_sum),
                             view_specs)
        view = jax.tree.map(_own_slice, layout.to_view(params), view_specs)
        updates, opt_state = tx.update(grads, opt_state, view)
        view = jax.tree.map(_all_gather, optax.apply_updates(view, updates), view_specs)
        return layout.from_view(view), opt_state, {"loss": jax.lax.pmean(loss, DATA_AXIS)}

    def fsdp_step(params, opt_state, inputs, targets):
        """XLA's partitioner places the collectives: it gathers each sharded weight where it is used and
        reduce-scatters its gradient; Muon's stacks are resharded from the parameters' layout."""
        with rows_partitioned(mesh):
            grad_sum, loss = accumulate(params, inputs, targets)
        grads = jax.lax.with_sharding_constraint(
            layout.to_view(jax.tree.map(lambda g: g / inputs.shape[0], grad_sum)), view_out)
        view = jax.lax.with_sharding_constraint(layout.to_view(params), view_out)
        updates, opt_state = tx.update(grads, opt_state, view)
        return layout.from_view(optax.apply_updates(view, updates)), opt_state, {"loss": loss}

    batch = batch_sharding(mesh)
    if state.fsdp:
        step = fsdp_step
    else:
        opt_specs = jax.tree.map(lambda s: s.spec, state.opt_shardings)
        # check_vma=False: the scans' zero-initialised carries are replicated values that become
        # per-device ones; every cross-device operation here is explicit.
        step = jax.shard_map(zero1_step, mesh=mesh, in_specs=(P(), opt_specs, batch.spec, batch.spec),
                             out_specs=(P(), opt_specs, P()), check_vma=False)

    def train_step(params, opt_state, inputs, targets):
        return step(params, opt_state, inputs, targets)

    return jax.jit(
        train_step,
        in_shardings=(state.param_shardings, state.opt_shardings, batch, batch),
        out_shardings=(state.param_shardings, state.opt_shardings, None),
        donate_argnums=(0, 1),
    )
