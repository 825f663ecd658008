"""The GPT of nanochat, in Flax NNX.

- rotary embeddings (no learned positions), QK norm after rotary
- untied token embedding and lm_head, vocabulary rows padded to a multiple of 64
- ReLU^2 MLP, no biases, RMSNorm without learnable parameters
- per-layer resid_lambdas / x0_lambdas mixing the residual stream with the first embedding
- GQA, sliding-window attention from a window pattern (last layer always full)
- logits soft-capped at 15, computed and reduced in float32, in chunks of positions (jaxchat.loss)

Parameters are float32. Matmuls run in the compute dtype: bfloat16 on accelerators, float32 on
CPU (where bf16 is emulated and slower). Flax kernels are (in, out): PyTorch's weights transposed.

Activation checkpointing (`remat`) chooses what each block keeps for the backward pass:
  none   everything autodiff saves (fastest, most memory)
  dots   only the outputs of the matmuls; norms, rotary, ReLU^2 and attention are recomputed
  block  only the block's input; the whole block is recomputed
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxchat import fp8
from jaxchat.attention import cached_attention, causal_attention, default_implementation
from jaxchat.common import compute_dtype
from jaxchat.loss import DEFAULT_CHUNK_LEN, softcap_logits, token_losses, token_scores

VOCAB_PAD_MULTIPLE = 64
ROTARY_BASE = 10_000
ROTARY_LENGTH_FACTOR = 10  # rotary positions exist for 10x the training length (for generation)


def _matmul_outputs_saveable(prim, *avals, **params) -> bool:
    """'dots': the outputs of the matmuls without batch dimensions (attention's have them). For an fp8
    matmul (jaxchat.fp8) that is its dequantised result in the compute dtype (named fp8.OUTPUT_NAME), not
    its float32 product before the scales (twice the bytes of bf16); its fp8 operands are recomputed."""
    if fp8.is_fp8_dot(prim, *avals, **params):
        return False
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        _matmul_outputs_saveable, jax.checkpoint_policies.save_only_these_names(fp8.OUTPUT_NAME)),
    "block": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6  # number of query heads
    n_kv_head: int = 6  # number of key/value heads (GQA)
    n_embd: int = 768
    window_pattern: str = "SSSL"  # tiled over layers: L = full context, S = half context

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        if not self.window_pattern or any(c not in "SL" for c in self.window_pattern.upper()):
            raise ValueError(f"window_pattern {self.window_pattern!r} must be a non-empty string of S and L")

    @classmethod
    def from_depth(cls, depth: int, vocab_size: int, *, aspect_ratio: int = 64, head_dim: int = 128,
                   max_seq_len: int = 2048, window_pattern: str = "SSSL") -> "GPTConfig":
        """nanochat's depth rule: model_dim = depth x aspect_ratio, heads of about head_dim
        (find_num_heads), as many key/value heads as query heads."""
        model_dim, num_heads = width_and_heads(depth, aspect_ratio, head_dim)
        return cls(sequence_len=max_seq_len, vocab_size=vocab_size, n_layer=depth, n_head=num_heads,
                   n_kv_head=num_heads, n_embd=model_dim, window_pattern=window_pattern)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def window_sizes(self) -> tuple[int, ...]:
        """Per-layer attention window: L -> sequence_len, S -> sequence_len // 2; last layer full."""
        pattern = self.window_pattern.upper()
        size = {"L": self.sequence_len, "S": self.sequence_len // 2}
        windows = [size[pattern[i % len(pattern)]] for i in range(self.n_layer)]
        windows[-1] = self.sequence_len
        return tuple(windows)


def width_and_heads(depth: int, aspect_ratio: int, head_dim: int) -> tuple[int, int]:
    """(model_dim, num_heads) of nanochat's depth rule; an odd head size (unusable by rotary) is an error."""
    model_dim = depth * aspect_ratio
    num_heads = find_num_heads(model_dim, head_dim)
    if (model_dim // num_heads) % 2:
        raise ValueError(f"model_dim {model_dim} with {num_heads} heads gives an odd head size {model_dim // num_heads}, "
                         "and rotary embeddings need an even one: change --depth, --aspect-ratio or --head-dim")
    return model_dim, num_heads


def find_num_heads(model_dim: int, target_head_dim: int) -> int:
    """The divisor of model_dim whose head size is closest to target_head_dim (nanochat's search)."""
    ideal = max(1, round(model_dim / target_head_dim))
    for offset in range(model_dim):
        for candidate in (ideal + offset, ideal - offset):
            if candidate > 0 and model_dim % candidate == 0:
                return candidate
    return 1


def rms_norm(x: jax.Array) -> jax.Array:
    """Parameter-free RMSNorm, computed in float32 and rounded once to x's dtype.

    eps is float32's machine epsilon for every dtype, as torch's F.rms_norm(eps=None), which takes
    the epsilon of its float32 compute type for bf16 inputs too (bf16's own, 7.8e-3, would shrink
    every normalised activation by ~0.4%).
    """
    eps = jnp.finfo(jnp.float32).eps
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def mix(x: jax.Array, x0: jax.Array, resid_lambda: jax.Array, x0_lambda: jax.Array) -> jax.Array:
    """resid_lambda * x + x0_lambda * x0 in float32, rounded once to x's dtype (as PyTorch's bf16 tensor
    times a float32 scalar): the lambdas are not rounded to bf16 first."""
    return (resid_lambda * x.astype(jnp.float32) + x0_lambda * x0.astype(jnp.float32)).astype(x.dtype)


def rotary_cos_sin(positions: jax.Array, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape (T, head_dim/2) for integer positions, rounded to bfloat16 as nanochat's table."""
    inv_freq = 1.0 / (ROTARY_BASE ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(jnp.bfloat16), jnp.sin(angles).astype(jnp.bfloat16)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (B, T, H, D). Rotate the two halves of the head dim: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos = cos[None, :, None, :].astype(x.dtype)
    sin = sin[None, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


def _symmetric_uniform(bound: float) -> nnx.Initializer:
    """uniform(-bound, bound); nanochat uses bound = sqrt(3/n_embd), the std of normal(0, 1/sqrt(n_embd))."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)

    return init


class Linear(nnx.Linear):
    """nnx.Linear whose matmul runs in fp8 (jaxchat.fp8) while fp8_enabled is set (use_fp8): the input in
    the compute dtype, the float32 kernel quantised directly, the result in the compute dtype."""

    fp8_enabled = False

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8_enabled:
            return fp8.matmul(x.astype(self.dtype), self.kernel[...])
        return super().__call__(x)


def _linear(fan_in: int, fan_out: int, axes: tuple[str, str], init: nnx.Initializer, dtype, rngs: nnx.Rngs) -> Linear:
    """A bias-free linear layer whose kernel (in, out) carries the logical axis names `axes` (jaxchat.mesh)."""
    return Linear(fan_in, fan_out, use_bias=False, kernel_init=init, dtype=dtype, param_dtype=jnp.float32,
                      kernel_metadata={"logical_axes": axes}, rngs=rngs)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for decoding, and how many positions are filled."""

    k: jax.Array  # (n_layer, B, max_len, n_kv_head, head_dim)
    v: jax.Array  # (n_layer, B, max_len, n_kv_head, head_dim)
    pos: jax.Array  # int32 scalar: positions 0 .. pos-1 hold valid keys/values


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, window: int, dtype, implementation: str, rngs: nnx.Rngs):
        n_embd, head_dim = config.n_embd, config.head_dim
        init = _symmetric_uniform(math.sqrt(3.0 / n_embd))
        self.c_q = _linear(n_embd, config.n_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_k = _linear(n_embd, config.n_kv_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_v = _linear(n_embd, config.n_kv_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_proj = _linear(n_embd, n_embd, ("heads", "embed"), jax.nn.initializers.zeros, dtype, rngs)
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, head_dim
        self.window = window
        self.implementation = implementation

    def _qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
        B, T, _ = x.shape
        q = self.c_q(x).reshape(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).reshape(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).reshape(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return rms_norm(q), rms_norm(k), v  # QK norm after rotary

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        B, T, C = x.shape
        q, k, v = self._qkv(x, cos, sin)
        y = causal_attention(q, k, v, self.window, self.implementation)
        return self.c_proj(y.reshape(B, T, C))

    def decode(self, x, cos, sin, cache: "KVCache", layer: int):
        """x: (B, t, C) at absolute positions cache.pos .. cache.pos+t-1. Writes this layer's new keys
        and values into the stacked cache in place (no copy of the other layers) and returns both."""
        B, t, C = x.shape
        q, k, v = self._qkv(x, cos, sin)
        start = (layer, 0, cache.pos, 0, 0)
        k_all = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start)
        v_all = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start)
        y = cached_attention(q, k_all[layer].astype(q.dtype), v_all[layer].astype(q.dtype), cache.pos, self.window)
        return self.c_proj(y.reshape(B, t, C)), cache.replace(k=k_all, v=v_all)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, dtype, rngs: nnx.Rngs):
        n_embd = config.n_embd
        self.c_fc = _linear(n_embd, 4 * n_embd, ("embed", "mlp"), _symmetric_uniform(math.sqrt(3.0 / n_embd)), dtype, rngs)
        self.c_proj = _linear(4 * n_embd, n_embd, ("mlp", "embed"), jax.nn.initializers.zeros, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x))))


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, window: int, dtype, implementation: str, rngs: nnx.Rngs):
        self.attn = CausalSelfAttention(config, window, dtype, implementation, rngs)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, cos, sin):
        x = x + self.attn(rms_norm(x), cos, sin)
        return x + self.mlp(rms_norm(x))


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, dtype=None, attention_implementation: str | None = None,
                 remat: str = "none", loss_chunk_len: int = DEFAULT_CHUNK_LEN, fp8: bool = False):
        """dtype: compute dtype of the matmuls (default: bf16 on accelerators, f32 on CPU).
        attention_implementation: 'cudnn' or 'xla' (default: cudnn on NVIDIA GPUs, else xla).
        remat: what each block keeps for the backward pass, a key of REMAT_POLICIES.
        loss_chunk_len: positions per chunk of the loss head (jaxchat.loss).
        fp8: train the linear layers that pass nanochat's filter in fp8 (use_fp8)."""
        self.config = config
        self.dtype = jnp.dtype(dtype or compute_dtype())
        implementation = attention_implementation or default_implementation()
        if implementation == "cudnn" and self.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError("cuDNN flash attention needs a bfloat16/float16 compute dtype; pass dtype=jnp.bfloat16")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {remat!r}: use one of {', '.join(REMAT_POLICIES)}")
        if loss_chunk_len < 1:
            raise ValueError(f"loss_chunk_len must be a positive number of positions, got {loss_chunk_len}")
        self.remat, self.loss_chunk_len = remat, loss_chunk_len
        V, C = config.padded_vocab_size, config.n_embd
        # Deliberately float32 (and so are its Adam moments), where nanochat stores wte and its moments in
        # bf16 on CUDA: bf16 would lose small Adam updates. Rows are cast after the lookup (_embed).
        self.wte = nnx.Embed(V, C, dtype=self.dtype, param_dtype=jnp.float32, embedding_init=jax.nn.initializers.normal(1.0),
                             embedding_metadata={"logical_axes": ("vocab", "embed")}, rngs=rngs)
        self.blocks = nnx.List(
            [Block(config, w, self.dtype, implementation, rngs) for w in config.window_sizes()]
        )
        self.lm_head = _linear(C, V, ("embed", "vocab"), jax.nn.initializers.normal(0.001), self.dtype, rngs)
        self.resid_lambdas = nnx.Param(jnp.ones((config.n_layer,), jnp.float32), logical_axes=("layers",))
        self.x0_lambdas = nnx.Param(jnp.zeros((config.n_layer,), jnp.float32), logical_axes=("layers",))
        use_fp8(self, fp8)

    # ---- forward -------------------------------------------------------------------------------
    def _embed(self, idx: jax.Array) -> jax.Array:
        # Rows of the float32 table, cast after the lookup: the gradient is a float32 scatter-add of
        # the token rows (a bf16 table would accumulate frequent tokens' gradients in bf16).
        return rms_norm(jnp.take(self.wte.embedding[...], idx, axis=0).astype(self.dtype))

    def _mix(self, i: int, x: jax.Array, x0: jax.Array) -> jax.Array:
        return mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])

    def _unembedding(self) -> jax.Array:
        """lm_head's kernel without the padded vocabulary columns: (C, vocab_size)."""
        return self.lm_head.kernel[:, : self.config.vocab_size]

    def hidden(self, idx: jax.Array) -> jax.Array:
        """idx (B, T) -> the normalised final hidden states (B, T, C) that the loss head reads."""
        cos, sin = rotary_cos_sin(jnp.arange(idx.shape[1]), self.config.head_dim)
        x = x0 = self._embed(idx)

        def layer(block, x, x0, lam, lam0):  # the residual mix inside: its float32 copies are never kept
            return block(mix(x, x0, lam, lam0), cos, sin)

        if self.remat != "none":
            layer = nnx.remat(layer, policy=REMAT_POLICIES[self.remat])
        for i, block in enumerate(self.blocks):
            x = layer(block, x, x0, self.resid_lambdas[i], self.x0_lambdas[i])
        return rms_norm(x)

    def __call__(self, idx: jax.Array, targets: jax.Array | None = None, loss_reduction: str = "mean") -> jax.Array:
        """idx: (B, T) int. Without targets: logits (B, T, vocab_size) float32. With targets: the
        cross-entropy, ignoring targets == -1: a scalar mean ('mean'), or (B, T) with 0 at ignored ('none').
        The loss never materialises the logits of the whole batch (jaxchat.loss)."""
        x = self.hidden(idx)
        if targets is None:
            return softcap_logits(x, self._unembedding())
        losses = token_losses(x, self._unembedding(), targets, self.loss_chunk_len, fp8=self.lm_head.fp8_enabled)
        return reduce_losses(losses, targets >= 0, loss_reduction)

    def token_scores(self, idx: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        """For evaluation: each token's loss (B, T) and whether the greedy prediction equals the target."""
        return token_scores(self.hidden(idx), self._unembedding(), targets, self.loss_chunk_len)

    # ---- decoding with a KV cache --------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty cache for up to max_len positions (at most 10x the training length, as the rotary table)."""
        limit = ROTARY_LENGTH_FACTOR * self.config.sequence_len
        if max_len > limit:
            raise ValueError(f"max_len {max_len} exceeds the rotary range of {limit} positions")
        c = self.config
        shape = (c.n_layer, batch_size, max_len, c.n_kv_head, c.head_dim)
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype), pos=jnp.zeros((), jnp.int32))

    def decode(self, idx: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Feed idx (B, t) at positions cache.pos .. cache.pos+t-1: a whole prompt (prefill) or one token.
        Returns the float32 logits (B, t, vocab_size) and the cache advanced by t."""
        t = idx.shape[1]
        cos, sin = rotary_cos_sin(cache.pos + jnp.arange(t), self.config.head_dim)
        x = x0 = self._embed(idx)
        for i, block in enumerate(self.blocks):
            x = self._mix(i, x, x0)
            y, cache = block.attn.decode(rms_norm(x), cos, sin, cache, i)
            x = x + y
            x = x + block.mlp(rms_norm(x))
        return softcap_logits(rms_norm(x), self._unembedding()), cache.replace(pos=cache.pos + t)

    # ---- counting --------------------------------------------------------------------------------
    def num_scaling_params(self) -> int:
        """All parameters, padded vocabulary rows included (nanochat's count)."""
        return count_params(nnx.state(self, nnx.Param))

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 x (params except wte and the lambdas) + attention's 12*H*D*window per layer."""
        return estimate_flops(self.config)


def use_fp8(model: nnx.Module, enabled: bool = True) -> tuple[int, int]:
    """Switch the fp8 matmuls of a model's linear layers on or off: nanochat's convert_to_float8_training
    with base_train.py's filter (nanochat at 92d63d4; jaxchat.fp8.eligible), lm_head included (its loss
    head then runs in fp8, jaxchat.loss). The weights are untouched: evaluation and sampling switch fp8
    off on the same parameters, as nanochat's disable_fp8. Returns (layers in fp8, linear layers)."""
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    for layer in layers:
        layer.fp8_enabled = enabled and fp8.eligible(layer.in_features, layer.out_features)
    return sum(layer.fp8_enabled for layer in layers), len(layers)


def reduce_losses(losses: jax.Array, valid: jax.Array, reduction: str = "mean") -> jax.Array:
    """Per-token losses (0 where not valid) -> 'mean' over valid tokens, 'sum', or 'none' (unchanged)."""
    if reduction == "none":
        return losses
    if reduction == "mean":
        return losses.sum() / jnp.maximum(valid.sum(), 1)
    if reduction == "sum":
        return losses.sum()
    raise ValueError(f"unknown loss_reduction {reduction!r}: use 'mean', 'sum' or 'none'")


def estimate_flops(config: GPTConfig) -> int:
    """Training FLOPs per token, nanochat's estimate: 6 x the weights of every matmul (the model's linear
    kernels, lm_head included; not wte, a lookup, nor the lambdas) + 12 x heads x head_dim x window for
    each layer's attention scores and values."""
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    matmul_params = sum(math.prod(node.kernel.shape) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear))
    attention = sum(12 * config.n_head * config.head_dim * min(w, config.sequence_len) for w in config.window_sizes())
    return 6 * matmul_params + attention


def logical_axes(params: nnx.State) -> list[tuple[str, ...]]:
    """The logical axis names of every parameter, in leaf order, as the model declared them (jaxchat.mesh)."""
    return [v.get_metadata()["logical_axes"] for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def count_params(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))

