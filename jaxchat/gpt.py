"""The GPT of nanochat, in Flax NNX.

- rotary embeddings (no learned positions), QK norm after rotary
- untied token embedding and lm_head, vocabulary rows padded to a multiple of 64
- ReLU^2 MLP, no biases, RMSNorm without learnable parameters
- per-layer resid_lambdas / x0_lambdas mixing the residual stream with the first embedding
- GQA, sliding-window attention from a window pattern (last layer always full)
- logits soft-capped at 15, computed and reduced in float32

Parameters are float32. Matmuls run in the compute dtype: bfloat16 on accelerators, float32 on
CPU (where bf16 is emulated and slower). Flax kernels are (in, out): PyTorch's weights transposed.
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.attention import cached_attention, causal_attention, default_implementation
from jaxchat.common import compute_dtype

VOCAB_PAD_MULTIPLE = 64
ROTARY_BASE = 10_000
ROTARY_LENGTH_FACTOR = 10  # rotary positions exist for 10x the training length (for generation)
LOGIT_SOFTCAP = 15.0


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


def _linear(fan_in: int, fan_out: int, init: nnx.Initializer, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        fan_in, fan_out, use_bias=False, kernel_init=init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs
    )


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
        self.c_q = _linear(n_embd, config.n_head * head_dim, init, dtype, rngs)
        self.c_k = _linear(n_embd, config.n_kv_head * head_dim, init, dtype, rngs)
        self.c_v = _linear(n_embd, config.n_kv_head * head_dim, init, dtype, rngs)
        self.c_proj = _linear(n_embd, n_embd, jax.nn.initializers.zeros, dtype, rngs)
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
        self.c_fc = _linear(n_embd, 4 * n_embd, _symmetric_uniform(math.sqrt(3.0 / n_embd)), dtype, rngs)
        self.c_proj = _linear(4 * n_embd, n_embd, jax.nn.initializers.zeros, dtype, rngs)

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
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, dtype=None, attention_implementation: str | None = None):
        """dtype: compute dtype of the matmuls (default: bf16 on accelerators, f32 on CPU).
        attention_implementation: 'cudnn' or 'xla' (default: cudnn on NVIDIA GPUs, else xla)."""
        self.config = config
        self.dtype = jnp.dtype(dtype or compute_dtype())
        implementation = attention_implementation or default_implementation()
        if implementation == "cudnn" and self.dtype not in (jnp.bfloat16, jnp.float16):
            raise ValueError("cuDNN flash attention needs a bfloat16/float16 compute dtype; pass dtype=jnp.bfloat16")
        V, C = config.padded_vocab_size, config.n_embd
        self.wte = nnx.Embed(V, C, dtype=self.dtype, param_dtype=jnp.float32,
                             embedding_init=jax.nn.initializers.normal(1.0), rngs=rngs)
        self.blocks = nnx.List(
            [Block(config, w, self.dtype, implementation, rngs) for w in config.window_sizes()]
        )
        self.lm_head = _linear(C, V, jax.nn.initializers.normal(0.001), self.dtype, rngs)
        self.resid_lambdas = nnx.Param(jnp.ones((config.n_layer,), jnp.float32))
        self.x0_lambdas = nnx.Param(jnp.zeros((config.n_layer,), jnp.float32))

    # ---- forward -------------------------------------------------------------------------------
    def _embed(self, idx: jax.Array) -> jax.Array:
        return rms_norm(self.wte(idx))

    def _mix(self, i: int, x: jax.Array, x0: jax.Array) -> jax.Array:
        lam = self.resid_lambdas[i].astype(x.dtype)
        lam0 = self.x0_lambdas[i].astype(x.dtype)
        return lam * x + lam0 * x0

    def _logits(self, x: jax.Array) -> jax.Array:
        logits = self.lm_head(rms_norm(x))[..., : self.config.vocab_size].astype(jnp.float32)
        return LOGIT_SOFTCAP * jnp.tanh(logits / LOGIT_SOFTCAP)

    def __call__(self, idx: jax.Array, targets: jax.Array | None = None, loss_reduction: str = "mean") -> jax.Array:
        """idx: (B, T) int. Without targets: logits (B, T, vocab_size) float32. With targets: the
        cross-entropy, ignoring targets == -1: a scalar mean ('mean'), or (B, T) with 0 at ignored ('none')."""
        T = idx.shape[1]
        cos, sin = rotary_cos_sin(jnp.arange(T), self.config.head_dim)
        x = x0 = self._embed(idx)
        for i, block in enumerate(self.blocks):
            x = block(self._mix(i, x, x0), cos, sin)
        logits = self._logits(x)
        if targets is None:
            return logits
        return cross_entropy(logits, targets, loss_reduction)

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
        return self._logits(x), cache.replace(pos=cache.pos + t)

    # ---- counting --------------------------------------------------------------------------------
    def num_scaling_params(self) -> int:
        """All parameters, padded vocabulary rows included (nanochat's count)."""
        return count_params(nnx.state(self, nnx.Param))

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 x (params except wte and the lambdas) + attention's 12*H*D*window per layer."""
        return estimate_flops(self.config)


def cross_entropy(logits: jax.Array, targets: jax.Array, reduction: str = "mean") -> jax.Array:
    """Float32 cross-entropy over the last axis; targets == -1 are ignored."""
    valid = targets >= 0
    safe_targets = jnp.where(valid, targets, 0)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    losses = jnp.where(valid, logz - target_logit, 0.0)
    if reduction == "none":
        return losses
    if reduction == "mean":
        return losses.sum() / jnp.maximum(valid.sum(), 1)
    if reduction == "sum":
        return losses.sum()
    raise ValueError(f"unknown loss_reduction {reduction!r}: use 'mean', 'sum' or 'none'")


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every parameter, by nanochat name, PyTorch (out, in) layout."""
    C, V, hd = config.n_embd, config.padded_vocab_size, config.head_dim
    shapes = {"transformer.wte.weight": (V, C)}
    for i in range(config.n_layer):
        p = f"transformer.h.{i}."
        shapes[p + "attn.c_q.weight"] = (config.n_head * hd, C)
        shapes[p + "attn.c_k.weight"] = (config.n_kv_head * hd, C)
        shapes[p + "attn.c_v.weight"] = (config.n_kv_head * hd, C)
        shapes[p + "attn.c_proj.weight"] = (C, C)
        shapes[p + "mlp.c_fc.weight"] = (4 * C, C)
        shapes[p + "mlp.c_proj.weight"] = (C, 4 * C)
    shapes["lm_head.weight"] = (V, C)
    shapes["resid_lambdas"] = (config.n_layer,)
    shapes["x0_lambdas"] = (config.n_layer,)
    return shapes


def estimate_flops(config: GPTConfig) -> int:
    shapes = param_shapes(config)
    excluded = ("transformer.wte.weight", "resid_lambdas", "x0_lambdas")
    matmul_params = sum(math.prod(s) for name, s in shapes.items() if name not in excluded)
    attention = sum(12 * config.n_head * config.head_dim * min(w, config.sequence_len) for w in config.window_sizes())
    return 6 * matmul_params + attention


def count_params(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


# ---- interop with nanochat's PyTorch state dict -------------------------------------------------
# (nanochat name, path in our nnx state, transpose?) -- nanochat's Linear weights are (out, in).
def _name_map(config: GPTConfig) -> list[tuple[str, tuple, bool]]:
    names = [("transformer.wte.weight", ("wte", "embedding"), False)]
    for i in range(config.n_layer):
        for sub, layer in (("attn", "c_q"), ("attn", "c_k"), ("attn", "c_v"), ("attn", "c_proj"),
                           ("mlp", "c_fc"), ("mlp", "c_proj")):
            names.append((f"transformer.h.{i}.{sub}.{layer}.weight", ("blocks", i, sub, layer, "kernel"), True))
    names.append(("lm_head.weight", ("lm_head", "kernel"), True))
    names.append(("resid_lambdas", ("resid_lambdas",), False))
    names.append(("x0_lambdas", ("x0_lambdas",), False))
    return names


def _get_path(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def to_nanochat_state_dict(model: GPT) -> dict[str, np.ndarray]:
    """nanochat's parameter names, PyTorch (out, in) layout, padded vocabulary rows kept; float32 numpy."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = {}
    for name, path, transpose in _name_map(model.config):
        value = np.asarray(jax.device_get(_get_path(params, path)), dtype=np.float32)
        out[name] = np.ascontiguousarray(value.T) if transpose else value
    return out


def from_nanochat_state_dict(config: GPTConfig, state_dict: dict, **model_kwargs) -> GPT:
    """The inverse of to_nanochat_state_dict: a GPT holding exactly those weights."""
    expected = param_shapes(config)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state dict does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), **model_kwargs))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for name, path, transpose in _name_map(config):
        value = np.asarray(state_dict[name], dtype=np.float32)
        if value.shape != expected[name]:
            raise ValueError(f"{name}: shape {value.shape}, expected {expected[name]} for this config")
        parent = _get_path(params, path[:-1])
        parent[path[-1]] = jnp.asarray(value.T if transpose else value)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model
