"""Causal sliding-window attention on TPU: Pallas' splash attention (jax.experimental.pallas.ops.tpu).

Splash attention is a flash-attention kernel over a block-sparse mask: the mask is known when the program is
traced, so blocks that a window or causality hides entirely are skipped, not computed and masked. Each
layer's mask is `LocalMask(window_size=(window, 0))`, query i seeing key j iff 0 <= i - j <= window (the
rule of jaxchat.model.attention), or `CausalMask` for a full-context layer. GQA: the kernel's MQA form (one key/value
head for many query heads), vmapped over the key/value heads. Its custom VJP is the backward pass, which reads
the forward kernel's output and logsumexp: `--remat dots` keeps them (splash_forward_saveable) instead of
running the forward kernel again. (The kernel's own residual_checkpoint_name does not do it: under
jax.checkpoint the policy sees its names, yet the forward ran again, JAX 0.10.2.)

Off a TPU it runs in Pallas' interpret mode (slow, exact: how the tests check it on the CPU).
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxchat.distributed.mesh import DATA_AXIS

# Tiles of 512 query rows x 512 keys (MaxText's defaults for its splash attention on v5e/v5p/v6e), forward and
# backward alike: at T = 2048 a short window of 1024 keys spans 3 key tiles of a query tile, not all 4, and each
# tile fills the MXU (128x128 on v5e, 256x256 on v6e). The kernel's tiles are whole multiples of the TPU's 128
# lanes, so other lengths take the longest such tile up to 512 that divides them.
SPLASH_BLOCK = 512
LANES = 128


def splash_forward_saveable(prim, *_, **params) -> bool:
    """A checkpoint policy: keep the results of splash attention's forward kernel (a pallas_call named
    splash_*_fwd_*): per layer B x T x C in the compute dtype and B x H x T float32 logsumexps."""
    if prim.name != "pallas_call":
        return False
    name = str(params.get("name", params.get("name_and_src_info", "")))
    return name.startswith("splash") and "_fwd" in name


def block_len(T: int) -> int:
    """The tile length for a sequence of T: the longest multiple of 128 up to SPLASH_BLOCK that divides T."""
    if T % LANES:
        raise ValueError(f"splash attention needs a sequence length that is a multiple of {LANES}, got {T}: "
                         f"change --max-seq-len, or pass --attention xla")
    return next(b for b in range(SPLASH_BLOCK, 0, -LANES) if T % b == 0)


@functools.lru_cache(maxsize=None)
def _kernel(T: int, window: int, group: int, interpret: bool):
    """The splash MQA kernel for `group` query heads sharing a key/value head, built once per shape (building
    one computes the mask's block map in NumPy)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if window >= T - 1:
        mask = masks.CausalMask((T, T))
    else:
        mask = masks.LocalMask((T, T), window_size=(window, 0), offset=0)
    block = block_len(T)
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    # concrete arrays even when first asked for inside a trace: the cached kernel outlives that trace
    with jax.ensure_compile_time_eval():
        return kernel.make_splash_mqa(masks.MultiHeadMask([mask] * group), block_sizes=sizes, head_shards=1,
                                      q_seq_shards=1, interpret=interpret)


_compiling_for_tpu = False  # set by compiling_for_tpu(): traced here, the program is for a TPU target


@contextlib.contextmanager
def compiling_for_tpu():
    """Trace splash attention's TPU kernel (not the interpreted one) on a machine without a TPU, inside this
    block: for programs compiled for a TPU target here (jaxchat.compiled.compile_only). Nothing runs inside it.
    (jax.lax.platform_dependent would choose at lowering, but a remat policy cannot see into its branches.)"""
    global _compiling_for_tpu
    saved, _compiling_for_tpu = _compiling_for_tpu, True
    try:
        yield
    finally:
        _compiling_for_tpu = saved


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, interpret: bool | None = None) -> jax.Array:
    """q: (B, T, H, D); k, v: (B, T, Hkv, D). Returns (B, T, H, D), scale 1/sqrt(D) (applied to q in float32,
    rounded once to q's dtype). interpret: None runs the kernel compiled on a TPU (or inside compiling_for_tpu),
    interpreted elsewhere.

    XLA cannot partition a Mosaic kernel ("wrap the call in a shard_map"): where a mesh's data axis is in
    context and not already manual (a jit over sharded rows: evaluation, --fsdp's step; see
    jaxchat.distributed.mesh.rows_partitioned), each device attends over its own rows in a shard_map. Inside the
    ZeRO-1 step's shard_map the rows are already each device's own."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in mesh.axis_names or DATA_AXIS in mesh.manual_axes:
        return _splash_local(q, k, v, window, interpret)
    # rows that do not split evenly (a single sampled row) are attended whole on every device
    rows = P(DATA_AXIS) if q.shape[0] % mesh.shape[DATA_AXIS] == 0 else P()
    local = functools.partial(_splash_local, window=window, interpret=interpret)
    return jax.shard_map(local, in_specs=(rows, rows, rows), out_specs=rows, check_vma=False)(q, k, v)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array, window: int, interpret: bool | None) -> jax.Array:
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    group = H // Hkv
    if interpret is None:
        interpret = not (_compiling_for_tpu or jax.default_backend() == "tpu")
    kernel = _kernel(T, window, group, interpret)
    q = (q.astype(jnp.float32) * D ** -0.5).astype(q.dtype)
    # (B, Hkv, group, T, D): query head h = kv * group + g reads key/value head kv (as jax.nn.dot_product_attention)
    q = q.transpose(0, 2, 1, 3).reshape(B, Hkv, group, T, D)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    y = jax.vmap(jax.vmap(kernel))(q, k, v)
    return y.reshape(B, H, T, D).transpose(0, 2, 1, 3)
