"""GPTs built and run as compiled programs, for tests. Compiling is most of the suite's time, and an eager
construction or forward compiles every operation it runs as a program of its own (a d2 forward: ~150 of
them, ~50 ms each on a 2-core machine): under jit each is one program. The maths is the same; XLA may fuse
and so round differently, within float32 rounding, which is what every tolerance here is derived from."""

import functools

from flax import nnx

from jaxchat.model.gpt import GPT, GPTConfig


def new_model(config: GPTConfig, seed: int = 0, **model_kwargs) -> GPT:
    """GPT(config, rngs=nnx.Rngs(seed), **model_kwargs), its initialisation one compiled program: the same
    values as the eager construction (jax.random is the same under jit)."""
    return _constructor(config, seed, tuple(sorted(model_kwargs.items())))()


@functools.cache
def _constructor(config: GPTConfig, seed: int, model_kwargs: tuple):
    return nnx.jit(lambda: GPT(config, rngs=nnx.Rngs(seed), **dict(model_kwargs)))


@functools.partial(nnx.jit, static_argnames=("loss_reduction",))
def forward(model: GPT, idx, targets=None, loss_reduction: str = "mean"):
    """model(idx, targets, loss_reduction), compiled once per model structure and shapes."""
    return model(idx, targets, loss_reduction=loss_reduction)
