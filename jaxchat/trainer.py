"""The train state and the jitted train step.

One optimizer step is one dispatch: a jax.jit over (params, opt_state, inputs, targets) that scans
over the micro-batches (gradient accumulation with lax.scan), averages the gradients and applies the
optimizer. Shardings are explicit on the way in and out, and the state buffers are donated, so XLA
updates them in place. Nothing here reads a value back to the host.
"""

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxchat.gpt import GPT, GPTConfig
from jaxchat.mesh import batch_sharding, optimizer_state_shardings, param_shardings, sharded


@dataclass
class TrainState:
    """Everything the step updates, plus the static structure needed to rebuild the model."""

    graphdef: Any  # nnx.GraphDef of the GPT: static, not part of the jitted state
    params: Any  # nnx.State of the parameters
    opt_state: Any  # optax state (includes the step count the schedules read)
    param_shardings: Any
    opt_shardings: Any

    def model(self) -> GPT:
        """A GPT holding the current parameters (shares their buffers; for eval and sampling)."""
        return nnx.merge(self.graphdef, self.params)


def abstract_model(config: GPTConfig, seed: int = 0, **model_kwargs) -> GPT:
    """The GPT's structure with ShapeDtypeStructs in place of arrays: no memory spent."""
    return nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(seed), **model_kwargs))


def abstract_train_state(config: GPTConfig, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                         fsdp: bool = False, seed: int = 0, **model_kwargs) -> TrainState:
    """The train state's shapes and shardings, with ShapeDtypeStructs for arrays: what a checkpoint
    is restored into, and what init_train_state fills."""
    graphdef, abstract_params = nnx.split(abstract_model(config, seed, **model_kwargs))
    p_shardings = param_shardings(abstract_params, mesh, fsdp)
    abstract_opt_state = jax.eval_shape(optimizer.init, abstract_params)
    o_shardings = optimizer_state_shardings(abstract_opt_state, mesh)
    return TrainState(graphdef, abstract_params, abstract_opt_state, p_shardings, o_shardings)


def init_train_state(config: GPTConfig, optimizer: optax.GradientTransformation, mesh: Mesh, *,
                     fsdp: bool = False, seed: int = 0, **model_kwargs) -> TrainState:
    """Initialise parameters and optimizer state directly into their shardings on the mesh, so no
    device ever holds a full copy it should not (eval_shape, then a jitted init with out_shardings)."""
    state = abstract_train_state(config, optimizer, mesh, fsdp=fsdp, seed=seed, **model_kwargs)

    def init_params():
        return nnx.state(GPT(config, rngs=nnx.Rngs(seed), **model_kwargs))

    state.params = jax.jit(init_params, out_shardings=state.param_shardings)()
    state.opt_state = jax.jit(optimizer.init, out_shardings=state.opt_shardings)(state.params)
    return state


def make_train_step(state: TrainState, optimizer: optax.GradientTransformation, mesh: Mesh) -> Callable:
    """Returns step(params, opt_state, inputs, targets) -> (params, opt_state, metrics).

    inputs/targets: (grad_accum, batch, T) int32, batch rows sharded over the mesh. The loss of each
    micro-batch is its mean over tokens; gradients are averaged over micro-batches, so k micro-batches
    of B rows equal one batch of k*B rows. metrics['loss'] is the mean micro-batch loss (a device scalar).
    """
    graphdef = state.graphdef
    # Accumulate gradients in the optimizer's (sharded) layout: each micro-batch's gradient is
    # reduce-scattered onto the shards instead of all-reduced, and the running sum takes 1/N memory.
    grad_shardings = sharded(state.params, mesh)

    def loss_fn(params, inputs, targets):
        return nnx.merge(graphdef, params)(inputs, targets)

    def train_step(params, opt_state, inputs, targets):
        def micro_step(grad_sum, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
            grad_sum = jax.tree.map(jnp.add, grad_sum, grads)
            return jax.lax.with_sharding_constraint(grad_sum, grad_shardings), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grad_sum, losses = jax.lax.scan(micro_step, zeros, (inputs, targets))
        grads = jax.tree.map(lambda g: g / inputs.shape[0], grad_sum)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": jnp.mean(losses)}

    batch = batch_sharding(mesh)
    return jax.jit(
        train_step,
        in_shardings=(state.param_shardings, state.opt_shardings, batch, batch),
        out_shardings=(state.param_shardings, state.opt_shardings, None),
        donate_argnums=(0, 1),
    )
