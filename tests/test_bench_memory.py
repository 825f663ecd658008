"""The pieces of `scripts.bench memory`: collectives parsed from HLO against hand counts, the activations
kept for the backward pass of a small function, tensor types of lowered StableHLO, and the whole
estimate on a d2 model."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxchat.model.gpt import GPTConfig
from jaxchat.compiled.compile_only import cudnn_without_gpu, partitioned_hlo
from jaxchat.compiled.hlo import SLICED_ALL_REDUCE, hlo_collectives, stablehlo_tensors
from jaxchat.model.footprint import kept_activations
from jaxchat.compiled.memory import memory_estimate
from jaxchat.train.run import RunSettings
from jaxchat.train.trainer import abstract_model

N = 8  # tests/conftest.py gives 8 CPU devices


def ring(kind: str, size: int, n: int = N) -> float:
    """Bytes one device moves, written out independently of the code under test."""
    return {"all-reduce": 2 * (n - 1) / n * size, "collective-permute": size}.get(kind, (n - 1) / n * size)


def test_collectives_of_an_eight_device_compile():
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))

    def body(a, b, c, e):
        return (jax.lax.psum(a, "d"),  # all-reduce of f32[16,32]: 2,048 bytes
                jax.lax.all_gather(b, "d", tiled=True),  # bf16[8,24] per device -> bf16[64,24]: 3,072 bytes
                jax.lax.psum_scatter(c, "d", tiled=True),  # f32[64,40] -> f32[8,40] per device: 10,240 bytes
                jax.lax.ppermute(e, "d", [(i, (i + 1) % N) for i in range(N)]))  # f32[4,4]: 64 bytes

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P(), P("d")),
                                 out_specs=(P(), P(), P("d"), P("d")), check_vma=False))
    args = (jnp.ones((16, 32)), jnp.ones((64, 24), jnp.bfloat16), jnp.ones((64, 40)), jnp.ones((32, 4)))
    text, source = partitioned_hlo(step.lower(*args))
    assert source == "after SPMD partitioning"
    found = sorted((c["kind"], c["group"], c["bytes"], c["moved"]) for c in hlo_collectives(text, N))
    assert found == sorted([("all-reduce", N, 2048, ring("all-reduce", 2048)),
                            ("all-gather", N, 3072, ring("all-gather", 3072)),
                            ("reduce-scatter", N, 10240, ring("reduce-scatter", 10240)),
                            ("collective-permute", 1, 64, 64.0)])


def test_an_all_reduce_sliced_per_device_is_a_reduce_scatter():
    # The gradient of replicated weights, constrained to a sharded layout: the SPMD partitioner writes
    # an all-reduce of the bf16 gradient and a dynamic-slice of each device's rows.
    mesh = Mesh(np.array(jax.devices()[:N]), ("d",))

    def grad_into_shards(w, x):
        g = jax.grad(lambda w: (x @ w.astype(jnp.bfloat16)).astype(jnp.float32).sum())(w)
        return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, P("d")))

    w = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((16, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P("d")))
    text, _ = partitioned_hlo(jax.jit(grad_into_shards).lower(w, x))
    [found] = hlo_collectives(text, N)
    size = 64 * 32 * 2  # the bf16 gradient
    assert (found["kind"], found["bytes"], found["moved"]) == (SLICED_ALL_REDUCE, size, ring("reduce-scatter", size))


# XLA:GPU's asynchronous forms, written by hand: every pair counts once, with the sync op's sizes.
GPU_HLO = """HloModule jit_step, entry_computation_layout={(f32[16,32]{1,0})->f32[16,32]{1,0}}

%wrapped_reduce_scatter (p: f32[64,40]) -> f32[8,40] {
  %p = f32[64,40]{1,0} parameter(0)
  ROOT %rs = f32[8,40]{1,0} reduce-scatter(f32[64,40]{1,0} %p), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[16,32], b: bf16[8,24], c: f32[64,40], e: f32[4,4]) -> f32[16,32] {
  %a = f32[16,32]{1,0} parameter(0)
  %b = bf16[8,24]{1,0} parameter(1)
  %c = f32[64,40]{1,0} parameter(2)
  %e = f32[4,4]{1,0} parameter(3)
  %all-reduce-start = f32[16,32]{1,0} all-reduce-start(f32[16,32]{1,0} %a), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %all-reduce-done = f32[16,32]{1,0} all-reduce-done(f32[16,32]{1,0} %all-reduce-start)
  %all-gather-start = (bf16[8,24]{1,0}, bf16[64,24]{1,0}) all-gather-start(bf16[8,24]{1,0} %b), channel_id=2, replica_groups=mesh['x'=8,'y'=1] {'x'}, dimensions={0}
  %all-gather-done = bf16[64,24]{1,0} all-gather-done((bf16[8,24]{1,0}, bf16[64,24]{1,0}) %all-gather-start)
  %reduce-scatter-start = ((f32[64,40]{1,0}), f32[8,40]{1,0}) async-start(f32[64,40]{1,0} %c), calls=%wrapped_reduce_scatter
  %reduce-scatter-done = f32[8,40]{1,0} async-done(((f32[64,40]{1,0}), f32[8,40]{1,0}) %reduce-scatter-start)
  %collective-permute-start = (f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) collective-permute-start(f32[4,4]{1,0} %e), channel_id=4, source_target_pairs={{0,1},{1,2}}
  %collective-permute-done = f32[4,4]{1,0} collective-permute-done((f32[4,4]{1,0}, f32[4,4]{1,0}, u32[], u32[]) %collective-permute-start)
  ROOT %all-to-all = f32[16,32]{1,0} all-to-all(f32[16,32]{1,0} %all-reduce-done), channel_id=5, replica_groups={}, dimensions={0}
}
"""


def test_async_forms_and_replica_group_spellings():
    found = sorted((c["kind"], c["group"], c["bytes"], c["moved"]) for c in hlo_collectives(GPU_HLO, N))
    assert found == sorted([("all-reduce", 4, 2048, ring("all-reduce", 2048, n=4)),  # groups of 4
                            ("all-gather", 8, 3072, ring("all-gather", 3072)),  # mesh form: axis x of 8
                            ("reduce-scatter", 8, 10240, ring("reduce-scatter", 10240)),  # iota form [1,8]
                            ("collective-permute", 1, 64, 64.0),
                            ("all-to-all", 8, 2048, ring("all-to-all", 2048))])  # no groups: all devices


def test_kept_activations_of_a_small_function():
    B, D, H = 3, 5, 7

    def loss(w1, w2, x):
        return jnp.sum(jnp.sin(x @ w1) @ w2)

    args = (jnp.ones((D, H)), jnp.ones((H, 2)), jnp.ones((B, D)))
    kept = kept_activations(loss, *args)
    # By hand: sin's derivative needs cos(x @ w1), and w2's gradient needs sin(x @ w1); x, w1 and w2
    # are arguments (kept, but not activations). Two float32 (B, H) arrays.
    assert sorted((r["dtype"], r["shape"]) for r in kept) == [("float32", (B, H))] * 2
    assert sum(r["bytes"] for r in kept) == 2 * B * H * 4
    assert sorted(r["source"].split(" from ")[0] for r in kept) == ["output of cos", "output of sin"]


def test_tensor_types_of_lowered_stablehlo():
    def f(x):
        return x.astype(jnp.float32) * 2.0

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((3, 5), jnp.bfloat16)).as_text()
    types = {(t["dtype"], t["shape"]): t["bytes"] for t in stablehlo_tensors(text)}
    assert types[("bf16", (3, 5))] == 3 * 5 * 2
    assert types[("f32", (3, 5))] == 3 * 5 * 4


def test_memory_estimate_of_a_d2_model():
    from jax._src.cudnn import fused_attention_stablehlo as fused

    devices, batch, seq, vocab = 2, 3, 256, 512  # B x T above every weight dimension, T above the loss chunk
    settings = RunSettings(depth=2, device_batch_size=batch, max_seq_len=seq, attention="cudnn", remat="dots")
    result = memory_estimate(settings, vocab, devices, device_gib=1.0)
    rows = {r["what"]: r["gib"] * 2**30 for r in result["per_device"]}
    config = GPTConfig.from_depth(2, vocab, max_seq_len=seq)
    L, C, V = config.n_layer, config.n_embd, config.padded_vocab_size
    matrices = 2 * V * C + L * 12 * C * C  # wte, lm_head; per block c_q, c_k, c_v, c_proj (C x C), c_fc, c_proj (4C x C)
    num_params = matrices + 2 * L  # + resid_lambdas, x0_lambdas
    assert rows["parameters"] == 4 * num_params  # float32, replicated
    assert rows["gradient accumulator"] == 4 * num_params  # float32, whole on each device until its reduce-scatter
    with cudnn_without_gpu() as gate:
        pass
    if gate == "assumed":  # no cuDNN here (the README's environment): the estimate says it got past the gate
        assert "version gate" in result["notes"][0]
        with pytest.raises(RuntimeError):  # ... and only inside the estimate
            fused.check_cudnn_version()
    else:  # the cuda12 extra brings cuDNN: its own gate answers, nothing to say
        assert gate == "real" and result["notes"] == []
    assert result["float32_logits_sized"] == []  # the loss head works in chunks
    # ZeRO-1 by hand: every float32 matrix reduce-scattered (its gradient) and all-gathered (its new value)
    # once; the lambdas' gradients (2 x L floats, no dimension to split) and the loss all-reduced
    moved = {}
    for row in result["collectives"][:-1]:
        kind = row["kind"].rstrip("*")  # a sliced all-reduce is a reduce-scatter on GPUs
        moved[kind] = moved.get(kind, 0) + row["moved_gib"] * 2**30
    assert moved == pytest.approx({"reduce-scatter": ring("reduce-scatter", 4 * matrices, devices),
                                   "all-gather": ring("all-gather", 4 * matrices, devices),
                                   "all-reduce": ring("all-reduce", 4 * (2 * L + 1), devices)}, rel=1e-12)
    minimum = 2 * (devices - 1) / devices * 4 * num_params
    assert result["zero1_minimum_gib"] * 2**30 == pytest.approx(minimum, rel=1e-12)


def test_dots_keeps_the_matmul_outputs_and_cudnn_attention():
    """What --remat dots keeps of each block, counted by hand: the outputs of its matmuls that a backward
    rule reads (q, k, v, attention's projection, the MLP's first; the MLP's last output only enters the
    residual sum, whose derivative needs no value) and cuDNN attention's output with its softmax
    statistics (float32, one per query and head): the backward pass never runs attention's forward again."""
    batch, seq, vocab = 3, 256, 512
    config = GPTConfig.from_depth(2, vocab, max_seq_len=seq)
    L, C, H = config.n_layer, config.n_embd, config.n_head
    with cudnn_without_gpu():
        graphdef, params = nnx.split(abstract_model(config, remat="dots", attention_implementation="cudnn",
                                                    dtype=jnp.bfloat16))
        tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        kept = kept_activations(lambda p, x, y: nnx.merge(graphdef, p)(x, y), params, tokens, tokens)
    matmuls = sorted(r["shape"] for r in kept if "dot_general" in r["source"] and "Linear" in r["source"])
    assert matmuls == sorted([(batch, seq, C)] * 4 * L + [(batch, seq, 4 * C)] * L)
    attention = sorted((r["dtype"], r["shape"]) for r in kept if "dot_product_attention_fwd" in r["source"])
    assert attention == sorted([("bfloat16", (batch, seq, H, C // H))] * L + [("float32", (batch, H, seq))] * L)


@pytest.mark.cuda_plugin
@pytest.mark.parametrize("devices", [1, 2])
def test_the_estimate_against_the_step_compiled_for_h100s(devices):
    """scripts.bench memory's estimate (abstract shapes, a CPU) against XLA's memory analysis of the same
    step compiled for H100s (jaxchat.compiled.compile_only). Needs JAX's CUDA plugin (the cuda12 extra), no GPU."""
    from jaxchat.compiled.compile_only import compile_for_target

    batch, seq, vocab = 4, 512, 8192
    settings = RunSettings(depth=2, device_batch_size=batch, max_seq_len=seq, remat="dots")
    estimate = {r["what"]: r["gib"] * 2**30 for r in memory_estimate(settings, vocab, devices)["per_device"]}
    compiled = {k: v * 2**30 for k, v in compile_for_target(settings, vocab, devices)["memory_gib"].items()}
    # the arguments are the state in its shardings and this device's rows of inputs and targets (int32), to the byte
    assert compiled["arguments"] == estimate["parameters"] + estimate["optimizer state"] + 2 * batch * seq * 4
    # The estimate counts every gradient of a micro-step alive at once (XLA frees each as it is added to the
    # accumulator) and leaves out XLA's working buffers, of which the loss head's are the largest: one
    # chunk's float32 logits and their gradient. The two figures differ by at most the larger of those.
    micro = estimate["micro-step gradients (upper bound)"]
    loss_chunk = 2 * batch * settings.loss_chunk_len * vocab * 4
    assert abs(compiled["peak"] - estimate["total"]) <= max(micro, loss_chunk), (compiled, estimate)
