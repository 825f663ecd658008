"""Steps of a tiny GPT on a fixed global batch over the devices of a mesh, each process feeding only the rows
that live on its own devices. test_multihost.py runs it as two jax.distributed processes (`python
multiprocess_worker.py P S` with JAX_COORDINATOR_ADDRESS set): five steps together, each loss printed as it comes,
then process P raises an out-of-memory of its own in step S (5), and every process ends as scripts.train's do;
it imports train_losses for the one-process reference of the five steps."""

import sys

import numpy as np


def train_losses(mesh, fails_at: tuple[int, int] | None = None, say=lambda line: None) -> list[float]:
    import jax
    from flax import nnx

    from jaxchat.model.gpt import GPTConfig
    from jaxchat.distributed.mesh import batch_sharding, put_batch
    from jaxchat.distributed.multihost import end_after_error
    from jaxchat.optim.recipes import setup_optimizer
    from jaxchat.train.trainer import abstract_model, init_train_state, make_train_step

    config = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    optimizer = setup_optimizer(nnx.state(abstract_model(config), nnx.Param), model_dim=config.n_embd,
                                depth=config.n_layer, num_iterations=5, total_batch_size=8 * config.sequence_len,
                                mesh=mesh)
    state = init_train_state(config, optimizer, mesh, seed=1)
    step = make_train_step(state, optimizer, mesh)
    spec = batch_sharding(mesh)
    rows = 8 // jax.process_count()
    lo = jax.process_index() * rows
    losses = []
    for s in range(5 if fails_at is None else fails_at[1] + 1):
        rng = np.random.default_rng(s)
        x = rng.integers(0, config.vocab_size, size=(1, 8, config.sequence_len)).astype(np.int32)
        y = np.roll(x, -1, axis=-1)
        try:
            if fails_at == (jax.process_index(), s):  # as XLA reports a device out of memory
                raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB.")
            state.params, state.opt_state, metrics = step(state.params, state.opt_state,
                                                          put_batch(x[:, lo:lo + rows], spec), put_batch(y[:, lo:lo + rows], spec))
            losses.append(float(metrics["loss"]))
            say(f"LOSS {s} {losses[-1]:.8f}")
        except (Exception, KeyboardInterrupt) as error:
            end_after_error(error, s, finish_saving=lambda: None, newest_step=lambda: None)
            raise
    return losses


if __name__ == "__main__":
    from jaxchat.distributed.mesh import make_mesh, maybe_initialize_distributed

    from jaxchat.distributed.multihost import watch_peers

    maybe_initialize_distributed()  # before anything touches a device
    watch_peers()
    mesh = make_mesh()
    assert mesh.devices.size == 4, mesh
    train_losses(mesh, tuple(map(int, sys.argv[1:3])) or None, say=lambda line: print(line, flush=True))
