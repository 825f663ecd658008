"""Run by test_trainer.py as a subprocess: train 5 steps of a tiny GPT on a fixed global batch, over
all devices of all processes (jax.distributed when JAX_COORDINATOR_ADDRESS is set), and print the losses.
Each process feeds only the rows that live on its own devices."""

import numpy as np

from jaxchat.mesh import maybe_initialize_distributed

maybe_initialize_distributed()

import jax  # noqa: E402

from jaxchat.gpt import GPTConfig  # noqa: E402
from jaxchat.mesh import batch_sharding, make_mesh, put_batch  # noqa: E402
from jaxchat.optim import setup_optimizer  # noqa: E402
from flax import nnx  # noqa: E402

from jaxchat.trainer import abstract_model, init_train_state, make_train_step  # noqa: E402

config = GPTConfig(sequence_len=32, vocab_size=256, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
mesh = make_mesh()
assert mesh.devices.size == 4, mesh
optimizer = setup_optimizer(nnx.state(abstract_model(config), nnx.Param), model_dim=config.n_embd, depth=config.n_layer, num_iterations=5,
                            total_batch_size=8 * config.sequence_len, mesh=mesh)
state = init_train_state(config, optimizer, mesh, seed=1)
step = make_train_step(state, optimizer, mesh)
spec = batch_sharding(mesh)
rows = 8 // jax.process_count()
lo = jax.process_index() * rows
losses = []
for s in range(5):
    rng = np.random.default_rng(s)
    x = rng.integers(0, config.vocab_size, size=(1, 8, config.sequence_len)).astype(np.int32)
    y = np.roll(x, -1, axis=-1)
    state.params, state.opt_state, metrics = step(state.params, state.opt_state,
                                                  put_batch(x[:, lo:lo + rows], spec), put_batch(y[:, lo:lo + rows], spec))
    losses.append(float(metrics["loss"]))
print("LOSSES " + " ".join(f"{v:.8f}" for v in losses), flush=True)
