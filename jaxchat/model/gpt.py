"""The GPT of nanochat, in Flax NNX.

- rotary embeddings (no learned positions), QK norm after rotary
- untied token embedding and lm_head, vocabulary rows padded to a multiple of 64
- ReLU^2 MLP, no biases, RMSNorm without learnable parameters
- per-layer resid_lambdas / x0_lambdas mixing the residual stream with the first embedding
- GQA, sliding-window attention from a window pattern (last layer always full)
- logits soft-capped at 15, computed and reduced in float32, in chunks of positions (jaxchat.model.loss)

A recipe names the nanochat commit whose GPT is built (GPTConfig.recipe, a key of RECIPES): 'bdcc030'
is the model above; '92d63d4' adds value embeddings, smear, backout, q/k x1.2 after the QK norm,
quarter-context short windows, rotary base 100,000 and that commit's init and depth rule. The
differences are data (ModelFeatures), read where the model is built and run.

Parameters are float32. Matmuls run in the compute dtype: bfloat16 on accelerators, float32 on
CPU (where bf16 is emulated and slower). Flax kernels are (in, out): PyTorch's weights transposed.

Activation checkpointing (`remat`) chooses what each block keeps for the backward pass:
  none   everything autodiff saves (fastest, most memory)
  dots   the outputs of the matmuls and of cuDNN's or splash attention's forward (its output and softmax
         statistics, what its backward reads); norms, rotary and ReLU^2 are recomputed, and so is
         attention on the XLA path (its scores are a batched matmul: T x T per head, too large to keep)
  block  only the block's input; the whole block is recomputed
"""

import dataclasses
import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxchat.model import fp8
from jaxchat.model.attention import cached_attention, causal_attention, default_implementation
from jaxchat.common import compute_dtype, per_process_cache
from jaxchat.model.splash_attention import splash_forward_saveable
from jaxchat.model.loss import DEFAULT_CHUNK_LEN, loss_sum_over, softcap_logits, token_losses, token_scores

VOCAB_PAD_MULTIPLE = 64
ROTARY_LENGTH_FACTOR = 10  # rotary positions exist for 10x the training length (for generation)
# The primitives of cuDNN flash attention's forward as jax.nn.dot_product_attention traces it (JAX's
# jax/_src/cudnn/fused_attention_stablehlo.py): the wrapper is what a checkpoint policy sees.
CUDNN_ATTENTION_FORWARD = frozenset({"dot_product_attention_fwd_wrapper", "dot_product_attention_fwd"})


def _cudnn_attention_saveable(prim, *_, **__) -> bool:
    """Keep cuDNN attention's forward results: its backward then reads them instead of running the
    forward kernel again. Costs per layer B x T x C in bf16 (the output) + B x H x T in float32 (the
    softmax statistics)."""
    return prim.name in CUDNN_ATTENTION_FORWARD


def _matmul_outputs_saveable(prim, *avals, **params) -> bool:
    """'dots': the outputs of the matmuls without batch dimensions (attention's have them). For an fp8
    matmul (jaxchat.model.fp8) that is its dequantised result in the compute dtype (named fp8.OUTPUT_NAME), not
    its float32 product before the scales (twice the bytes of bf16); its fp8 operands are recomputed."""
    if fp8.is_fp8_dot(prim, *avals, **params):
        return False
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)


REMAT_POLICIES = {
    "none": None,
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.save_from_both_policies(_matmul_outputs_saveable, _cudnn_attention_saveable),
        jax.checkpoint_policies.save_from_both_policies(jax.checkpoint_policies.save_only_these_names(fp8.OUTPUT_NAME),
                                                        splash_forward_saveable)),
    "block": jax.checkpoint_policies.nothing_saveable,
}


@dataclasses.dataclass(frozen=True)
class ModelFeatures:
    """Where nanochat's GPT differs between commits (nanochat/gpt.py and scripts/base_train.py at each).

    Init table (bound b = sqrt(3 / n_embd), uniform(-b, b) has the std of normal(0, 1/sqrt(n_embd))):
      wte             normal(0, wte_std)             lm_head        normal(0, 0.001)
      c_q, c_k, c_v   uniform(-b, b)                 c_fc           uniform(-fc_init_scale b, fc_init_scale b)
      both c_proj     zeros                          value embeds   uniform(-b, b), as c_v
      resid_lambdas   start - decrease * i / max(n_layer - 1, 1), for (start, decrease) = resid_lambda_init
      x0_lambdas      the same with x0_lambda_init
      smear_gate, ve_gate  uniform(0, 0.02)          smear_lambda 0, backout_lambda 0.2
    """

    value_embeds: bool  # a (vocab, n_kv_head*head_dim) table on alternate layers, the last included, added to v
    smear: bool  # the previous token's normalised embedding mixed into each position through a gate
    backout: bool  # backout_lambda x the residual after layer n_layer // 2, subtracted before the final norm
    qk_scale: float  # q and k are multiplied by it after the QK norm
    rotary_base: int
    rotary_in_compute_dtype: bool  # the cos/sin table in the compute dtype (92d63d4), else rounded to bf16 always
    short_window: str  # a key of SHORT_WINDOW_RULES: how far back an S layer sees
    depth_rule: str  # a key of DEPTH_RULES: (model_dim, num_heads) from depth, aspect ratio and head_dim
    scaling_params: str  # what the data:param ratio counts: 'all' parameters, or 'matrices' (blocks + lm_head)
    wte_std: float
    fc_init_scale: float
    resid_lambda_init: tuple[float, float]  # (first layer, decrease to the last layer)
    x0_lambda_init: tuple[float, float]


RECIPES = {
    # karpathy/nanochat at bdcc030 (January 2026): jaxchat's seed; kept to the bit.
    # Its rotary table is bf16 whatever the compute dtype (nanochat/gpt.py there: `cos.bfloat16()`).
    "bdcc030": ModelFeatures(value_embeds=False, smear=False, backout=False, qk_scale=1.0, rotary_base=10_000,
                             rotary_in_compute_dtype=False, short_window="half", depth_rule="divisor",
                             scaling_params="all", wte_std=1.0, fc_init_scale=1.0, resid_lambda_init=(1.0, 0.0),
                             x0_lambda_init=(0.0, 0.0)),
    # karpathy/nanochat at 92d63d4: nanochat/gpt.py's GPT and init_weights, base_train.py's build_model_meta
    # and get_scaling_params. Its rotary table is in the compute dtype (`cos.to(COMPUTE_DTYPE)`): float32 in a
    # float32 run.
    "92d63d4": ModelFeatures(value_embeds=True, smear=True, backout=True, qk_scale=1.2, rotary_base=100_000,
                             rotary_in_compute_dtype=True, short_window="quarter_tiles", depth_rule="round_up",
                             scaling_params="matrices", wte_std=0.8, fc_init_scale=0.4,
                             resid_lambda_init=(1.15, 0.10), x0_lambda_init=(0.20, 0.15)),
}
DEFAULT_RECIPE = "bdcc030"
SHORT_WINDOW_RULES = {
    "half": lambda seq_len: seq_len // 2,
    "quarter_tiles": lambda seq_len: -(-seq_len // 4 // 128) * 128,  # a quarter, up to whole FA3 tiles of 128
}
VE_GATE_CHANNELS = 12  # the value-embedding gate reads the first 12 channels of the attention input
VE_GATE_RANGE = 3.0  # gate = 3 sigmoid(.), in (0, 3)
SMEAR_GATE_CHANNELS = 24  # the smear gate reads the first 24 channels of the normalised embedding
GATE_INIT_MAX = 0.02  # both gates start at uniform(0, 0.02): slightly above neutral
BACKOUT_LAMBDA_INIT = 0.2


def has_value_embed(layer: int, n_layer: int) -> bool:
    """Value embeddings on alternate layers, the last always among them (nanochat 92d63d4 has_ve)."""
    return layer % 2 == (n_layer - 1) % 2


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6  # number of query heads
    n_kv_head: int = 6  # number of key/value heads (GQA)
    n_embd: int = 768
    window_pattern: str = "SSSL"  # tiled over layers: L = full context, S = a short window (features.short_window)
    recipe: str = DEFAULT_RECIPE  # the nanochat commit whose GPT this is: a key of RECIPES

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"unknown recipe {self.recipe!r}: use one of {', '.join(RECIPES)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}")
        check_window_pattern(self.window_pattern)

    @classmethod
    def from_depth(cls, depth: int, vocab_size: int, *, aspect_ratio: int = 64, head_dim: int = 128,
                   max_seq_len: int = 2048, window_pattern: str = "SSSL", recipe: str = DEFAULT_RECIPE) -> "GPTConfig":
        """nanochat's depth rule of that recipe (width_and_heads), as many key/value heads as query heads."""
        model_dim, num_heads = width_and_heads(depth, aspect_ratio, head_dim, recipe)
        return cls(sequence_len=max_seq_len, vocab_size=vocab_size, n_layer=depth, n_head=num_heads,
                   n_kv_head=num_heads, n_embd=model_dim, window_pattern=window_pattern, recipe=recipe)

    @property
    def features(self) -> ModelFeatures:
        return RECIPES[self.recipe]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def window_sizes(self) -> tuple[int, ...]:
        """Per-layer attention window: L -> sequence_len, S -> the recipe's short window; last layer full."""
        pattern = self.window_pattern.upper()
        size = {"L": self.sequence_len, "S": SHORT_WINDOW_RULES[self.features.short_window](self.sequence_len)}
        windows = [size[pattern[i % len(pattern)]] for i in range(self.n_layer)]
        windows[-1] = self.sequence_len
        return tuple(windows)

    def value_embed_layers(self) -> tuple[int, ...]:
        """The layers with a value embedding (none unless the recipe has them)."""
        if not self.features.value_embeds:
            return ()
        return tuple(i for i in range(self.n_layer) if has_value_embed(i, self.n_layer))

def check_window_pattern(pattern: str) -> None:
    """A window pattern is a non-empty string of S (half context) and L (full context)."""
    if not pattern or any(c not in "SL" for c in pattern.upper()):
        raise ValueError(f"window_pattern {pattern!r} must be made of S (half context) and L (full context)")


def width_and_heads(depth: int, aspect_ratio: int, head_dim: int, recipe: str = DEFAULT_RECIPE) -> tuple[int, int]:
    """(model_dim, num_heads) of the recipe's depth rule; an odd head size (unusable by rotary) is an error."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}: use one of {', '.join(RECIPES)}")
    model_dim, num_heads = DEPTH_RULES[RECIPES[recipe].depth_rule](depth * aspect_ratio, head_dim)
    if (model_dim // num_heads) % 2:
        raise ValueError(f"model_dim {model_dim} with {num_heads} heads gives an odd head size {model_dim // num_heads}, "
                         "and rotary embeddings need an even one: change --depth, --aspect-ratio or --head-dim")
    return model_dim, num_heads


def _divisor_rule(base_dim: int, head_dim: int) -> tuple[int, int]:
    """nanochat bdcc030: model_dim = depth x aspect_ratio, heads of about head_dim (find_num_heads)."""
    return base_dim, find_num_heads(base_dim, head_dim)


def _round_up_rule(base_dim: int, head_dim: int) -> tuple[int, int]:
    """nanochat 92d63d4 (base_train.py build_model_meta): model_dim = depth x aspect_ratio rounded up to a
    multiple of head_dim, so that every head is exactly head_dim wide."""
    model_dim = -(-base_dim // head_dim) * head_dim
    return model_dim, model_dim // head_dim


DEPTH_RULES = {"divisor": _divisor_rule, "round_up": _round_up_rule}


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


def scale(x: jax.Array, factor: float) -> jax.Array:
    """x * factor in float32, rounded once to x's dtype (as PyTorch's bf16 tensor times a Python float:
    the factor is not rounded to bf16 first, where JAX's weak typing would round 1.2 to 1.203125)."""
    return (x.astype(jnp.float32) * factor).astype(x.dtype)


def rotary_cos_sin(positions: jax.Array, head_dim: int, base: int = RECIPES[DEFAULT_RECIPE].rotary_base,
                   dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """cos/sin of shape (T, head_dim/2) for integer positions, computed in float32 and rounded to `dtype` as
    nanochat's table (bfloat16 at bdcc030; the compute dtype at 92d63d4: ModelFeatures.rotary_in_compute_dtype)."""
    inv_freq = 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: (B, T, H, D). Rotate the two halves of the head dim: y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos = cos[None, :, None, :].astype(x.dtype)
    sin = sin[None, :, None, :].astype(x.dtype)
    return jnp.concatenate([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], axis=-1)


def _symmetric_uniform(bound: float) -> nnx.Initializer:
    """uniform(-bound, bound); nanochat uses bound = sqrt(3/n_embd), the std of normal(0, 1/sqrt(n_embd))."""
    return _uniform(-bound, bound)


def _uniform(low: float, high: float) -> nnx.Initializer:
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, minval=low, maxval=high)

    return init


class Linear(nnx.Linear):
    """nnx.Linear whose matmul runs in fp8 (jaxchat.model.fp8) while fp8_enabled is set (use_fp8): the input in
    the compute dtype, the float32 kernel quantised directly, the result in the compute dtype."""

    fp8_enabled = False

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.fp8_enabled:
            return fp8.matmul(x.astype(self.dtype), self.kernel[...])
        return super().__call__(x)


def _linear(fan_in: int, fan_out: int, axes: tuple, init: nnx.Initializer, dtype, rngs: nnx.Rngs) -> Linear:
    """A bias-free linear layer whose kernel (in, out) carries the logical axis names `axes` (jaxchat.distributed.mesh)."""
    return Linear(fan_in, fan_out, use_bias=False, kernel_init=init, dtype=dtype, param_dtype=jnp.float32,
                      kernel_metadata={"logical_axes": axes}, rngs=rngs)


def _lambda_ramp(start: float, decrease: float, n_layer: int) -> jax.Array:
    """start - decrease * i / max(n_layer - 1, 1) for each layer i, in Python floats as nanochat's
    init_weights, stored as float32 (exactly ones or zeros when decrease is 0)."""
    return jnp.asarray([start - decrease * i / max(n_layer - 1, 1) for i in range(n_layer)], jnp.float32)


def _embedding_rows(table: jax.Array, idx: jax.Array, dtype) -> jax.Array:
    # Rows of a float32 table, cast after the lookup: the gradient is a float32 scatter-add of the
    # token rows (a bf16 table would accumulate frequent tokens' gradients in bf16).
    return jnp.take(table, idx, axis=0).astype(dtype)


@flax.struct.dataclass
class KVCache:
    """Keys and values of every layer for decoding, and how many positions are filled."""

    k: jax.Array  # (n_layer, B, max_len, n_kv_head, head_dim)
    v: jax.Array  # (n_layer, B, max_len, n_kv_head, head_dim)
    pos: jax.Array  # int32 scalar: positions 0 .. pos-1 hold valid keys/values
    # smear only: (B, 1, C) the normalised embedding of position pos-1 (zeros before any, which smears nothing)
    prev_embedding: jax.Array | None = None

    def repeat_rows(self, n: int) -> "KVCache":
        """Every row repeated n times (several samples continuing one prefilled prompt)."""
        prev = None if self.prev_embedding is None else jnp.repeat(self.prev_embedding, n, axis=0)
        return self.replace(k=jnp.repeat(self.k, n, axis=1), v=jnp.repeat(self.v, n, axis=1), prev_embedding=prev)


class CausalSelfAttention(nnx.Module):
    def __init__(self, config: GPTConfig, window: int, dtype, implementation: str, rngs: nnx.Rngs,
                 value_embed: bool = False):
        n_embd, head_dim = config.n_embd, config.head_dim
        init = _symmetric_uniform(math.sqrt(3.0 / n_embd))
        self.c_q = _linear(n_embd, config.n_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_k = _linear(n_embd, config.n_kv_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_v = _linear(n_embd, config.n_kv_head * head_dim, ("embed", "heads"), init, dtype, rngs)
        self.c_proj = _linear(n_embd, n_embd, ("heads", "embed"), jax.nn.initializers.zeros, dtype, rngs)
        # the gate of this layer's value embedding: one per key/value head, from the first input channels
        self.ve_gate = _linear(VE_GATE_CHANNELS, config.n_kv_head, (None, "heads"), _uniform(0.0, GATE_INIT_MAX),
                               dtype, rngs) if value_embed else None
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, head_dim
        self.qk_scale = config.features.qk_scale
        self.window = window
        self.implementation = implementation

    def _qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ve: jax.Array | None = None):
        B, T, _ = x.shape
        q = self.c_q(x).reshape(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).reshape(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).reshape(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # value residual (ResFormer), gated per key/value head
            gate = VE_GATE_RANGE * jax.nn.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))  # (B, T, n_kv_head)
            v = v + gate[..., None] * ve.reshape(B, T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = rms_norm(q), rms_norm(k)  # QK norm after rotary
        if self.qk_scale != 1.0:  # sharper attention, the scale split between q and k
            q, k = scale(q, self.qk_scale), scale(k, self.qk_scale)
        return q, k, v

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, ve: jax.Array | None = None) -> jax.Array:
        B, T, C = x.shape
        q, k, v = self._qkv(x, cos, sin, ve)
        y = causal_attention(q, k, v, self.window, self.implementation)
        return self.c_proj(y.reshape(B, T, C))

    def decode(self, x, cos, sin, cache: "KVCache", layer: int, ve: jax.Array | None = None):
        """x: (B, t, C) at absolute positions cache.pos .. cache.pos+t-1. Writes this layer's new keys
        and values into the stacked cache in place (no copy of the other layers) and returns both."""
        B, t, C = x.shape
        q, k, v = self._qkv(x, cos, sin, ve)
        start = (layer, 0, cache.pos, 0, 0)
        k_all = jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), start)
        v_all = jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), start)
        y = cached_attention(q, k_all[layer].astype(q.dtype), v_all[layer].astype(q.dtype), cache.pos, self.window)
        return self.c_proj(y.reshape(B, t, C)), cache.replace(k=k_all, v=v_all)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, dtype, rngs: nnx.Rngs):
        n_embd = config.n_embd
        bound = math.sqrt(3.0 / n_embd) * config.features.fc_init_scale
        self.c_fc = _linear(n_embd, 4 * n_embd, ("embed", "mlp"), _symmetric_uniform(bound), dtype, rngs)
        self.c_proj = _linear(4 * n_embd, n_embd, ("mlp", "embed"), jax.nn.initializers.zeros, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x))))


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, window: int, dtype, implementation: str, rngs: nnx.Rngs,
                 value_embed: bool = False):
        self.attn = CausalSelfAttention(config, window, dtype, implementation, rngs, value_embed)
        self.mlp = MLP(config, dtype, rngs)

    def __call__(self, x, cos, sin, ve=None):
        x = x + self.attn(rms_norm(x), cos, sin, ve)
        return x + self.mlp(rms_norm(x))


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, dtype=None, attention_implementation: str | None = None,
                 remat: str = "none", loss_chunk_len: int = DEFAULT_CHUNK_LEN, fp8: bool = False):
        """dtype: compute dtype of the matmuls (default: bf16 on accelerators, f32 on CPU).
        attention_implementation: 'cudnn', 'splash' or 'xla' (default: jaxchat.model.attention.default_implementation).
        remat: what each block keeps for the backward pass, a key of REMAT_POLICIES.
        loss_chunk_len: positions per chunk of the loss head (jaxchat.model.loss).
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
        features, V, C, L = config.features, config.padded_vocab_size, config.n_embd, config.n_layer
        # Deliberately float32 (and so are its Adam moments), where nanochat stores wte and its moments in
        # bf16 on CUDA: bf16 would lose small Adam updates. Rows are cast after the lookup (_embedding_rows).
        self.wte = nnx.Embed(V, C, dtype=self.dtype, param_dtype=jnp.float32,
                             embedding_init=jax.nn.initializers.normal(features.wte_std),
                             embedding_metadata={"logical_axes": ("vocab", "embed")}, rngs=rngs)
        ve_layers = config.value_embed_layers()
        self.blocks = nnx.List(
            [Block(config, w, self.dtype, implementation, rngs, i in ve_layers) for i, w in enumerate(config.window_sizes())]
        )
        self.lm_head = _linear(C, V, ("embed", "vocab"), jax.nn.initializers.normal(0.001), self.dtype, rngs)
        self.resid_lambdas = nnx.Param(_lambda_ramp(*features.resid_lambda_init, L), logical_axes=("layers",))
        self.x0_lambdas = nnx.Param(_lambda_ramp(*features.x0_lambda_init, L), logical_axes=("layers",))
        # the 92d63d4 parameters, None where the recipe has none (a bdcc030 model's tree is what it was)
        self.smear_gate = _linear(SMEAR_GATE_CHANNELS, 1, (None, None), _uniform(0.0, GATE_INIT_MAX), self.dtype,
                                  rngs) if features.smear else None
        self.smear_lambda = nnx.Param(jnp.zeros((1,), jnp.float32), logical_axes=(None,)) if features.smear else None
        self.backout_lambda = nnx.Param(jnp.full((1,), BACKOUT_LAMBDA_INIT, jnp.float32),
                                        logical_axes=(None,)) if features.backout else None
        # Deliberately float32 as wte (nanochat 92d63d4 keeps them in bf16 on CUDA), and their Adam moments too.
        self.value_embeds = nnx.Dict({str(i): nnx.Embed(
            V, config.n_kv_head * config.head_dim, dtype=self.dtype, param_dtype=jnp.float32,
            embedding_init=_symmetric_uniform(math.sqrt(3.0 / C)),
            embedding_metadata={"logical_axes": ("vocab", "heads")}, rngs=rngs) for i in ve_layers}) if ve_layers else None
        use_fp8(self, fp8)

    # ---- forward -------------------------------------------------------------------------------
    def _embed(self, idx: jax.Array) -> jax.Array:
        return rms_norm(_embedding_rows(self.wte.embedding[...], idx, self.dtype))

    def _smear(self, x: jax.Array, previous: jax.Array) -> jax.Array:
        """x_t + smear_lambda sigmoid(smear_gate(x_t[:24])) x_{t-1}, x: (B, t, C) normalised embeddings and
        previous: (B, 1, C) the one before x[:, 0] (zeros at the start of a sequence: nothing is added)."""
        shifted = jnp.concatenate([previous.astype(x.dtype), x[:, :-1]], axis=1)
        gate = self.smear_lambda[...].astype(x.dtype) * jax.nn.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))
        return x + gate * shifted

    def _value_table(self, i: int) -> jax.Array | None:
        if self.value_embeds is None or str(i) not in self.value_embeds:
            return None
        return self.value_embeds[str(i)].embedding[...]

    def _backout(self, x: jax.Array, x_mid: jax.Array) -> jax.Array:
        """The mid-layer residual subtracted before the final norm (it carries low-level features)."""
        return x - self.backout_lambda[...].astype(x.dtype) * x_mid

    def _mix(self, i: int, x: jax.Array, x0: jax.Array) -> jax.Array:
        return mix(x, x0, self.resid_lambdas[i], self.x0_lambdas[i])

    def _rotary(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        features = self.config.features
        dtype = self.dtype if features.rotary_in_compute_dtype else jnp.bfloat16
        return rotary_cos_sin(positions, self.config.head_dim, features.rotary_base, dtype)

    def _unembedding(self) -> jax.Array:
        """lm_head's kernel without the padded vocabulary columns: (C, vocab_size)."""
        return self.lm_head.kernel[:, : self.config.vocab_size]

    def hidden(self, idx: jax.Array) -> jax.Array:
        """idx (B, T) -> the normalised final hidden states (B, T, C) that the loss head reads."""
        cos, sin = self._rotary(jnp.arange(idx.shape[1]))
        x = self._embed(idx)
        if self.smear_gate is not None:
            x = self._smear(x, jnp.zeros_like(x[:, :1]))
        x0 = x

        def layer(block, x, x0, lam, lam0, ve_table):  # the residual mix inside: its float32 copies are never kept
            ve = None if ve_table is None else _embedding_rows(ve_table, idx, self.dtype)
            return block(mix(x, x0, lam, lam0), cos, sin, ve)

        if self.remat != "none":
            layer = nnx.remat(layer, policy=REMAT_POLICIES[self.remat])
        x_mid = None
        for i, block in enumerate(self.blocks):
            x = layer(block, x, x0, self.resid_lambdas[i], self.x0_lambdas[i], self._value_table(i))
            if i == self.config.n_layer // 2:
                x_mid = x
        if self.backout_lambda is not None:
            x = self._backout(x, x_mid)
        return rms_norm(x)

    def __call__(self, idx: jax.Array, targets: jax.Array | None = None, loss_reduction: str = "mean") -> jax.Array:
        """idx: (B, T) int. Without targets: logits (B, T, vocab_size) float32. With targets: the
        cross-entropy, ignoring targets == -1: a scalar mean ('mean'), or (B, T) with 0 at ignored ('none').
        The loss never materialises the logits of the whole batch (jaxchat.model.loss)."""
        x = self.hidden(idx)
        if targets is None:
            return softcap_logits(x, self._unembedding())
        w, fp8_on = self._unembedding(), self.lm_head.fp8_enabled
        if loss_reduction == "none":  # each token's (0 where the target is -1)
            return token_losses(x, w, targets, self.loss_chunk_len, fp8=fp8_on)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"unknown loss_reduction {loss_reduction!r}: use 'mean', 'sum' or 'none'")
        # a training loss: its head computes the gradients with it (jaxchat.model.loss.loss_sum_over)
        divisor = jnp.maximum((targets >= 0).sum(), 1) if loss_reduction == "mean" else 1
        return loss_sum_over(x, w, targets, divisor, self.loss_chunk_len, fp8=fp8_on)

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
        prev = jnp.zeros((batch_size, 1, c.n_embd), self.dtype) if self.smear_gate is not None else None
        return KVCache(k=jnp.zeros(shape, self.dtype), v=jnp.zeros(shape, self.dtype), pos=jnp.zeros((), jnp.int32),
                       prev_embedding=prev)

    def decode(self, idx: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Feed idx (B, t) at positions cache.pos .. cache.pos+t-1: a whole prompt (prefill) or one token.
        Returns the float32 logits (B, t, vocab_size) and the cache advanced by t."""
        t = idx.shape[1]
        cos, sin = self._rotary(cache.pos + jnp.arange(t))
        x = self._embed(idx)
        if self.smear_gate is not None:
            x, cache = self._smear(x, cache.prev_embedding), cache.replace(prev_embedding=x[:, -1:])
        x0, x_mid = x, None
        for i, block in enumerate(self.blocks):
            x = self._mix(i, x, x0)
            ve_table = self._value_table(i)
            ve = None if ve_table is None else _embedding_rows(ve_table, idx, self.dtype)
            y, cache = block.attn.decode(rms_norm(x), cos, sin, cache, i, ve)
            x = x + y
            x = x + block.mlp(rms_norm(x))
            if i == self.config.n_layer // 2:
                x_mid = x
        if self.backout_lambda is not None:
            x = self._backout(x, x_mid)
        return softcap_logits(rms_norm(x), self._unembedding()), cache.replace(pos=cache.pos + t)

    def rewind_cache(self, cache: KVCache, pos: jax.Array, idx: jax.Array) -> KVCache:
        """The cache as if only idx[:, :pos] had been fed, after idx was fed whole from position 0 (a prompt
        padded on the right): the next step writes at pos, overwriting the padding's keys and values, and
        the smear reads the embedding of idx[:, pos-1]."""
        cache = cache.replace(pos=jnp.asarray(pos, jnp.int32))
        if cache.prev_embedding is None:
            return cache
        return cache.replace(prev_embedding=self._embed(jax.lax.dynamic_slice_in_dim(idx, pos - 1, 1, axis=1)))

    # ---- counting --------------------------------------------------------------------------------
    def num_scaling_params(self) -> int:
        """The parameters the data:param ratio counts (the recipe's rule): bdcc030 all of them, padded
        vocabulary rows included; 92d63d4 the block matrices and lm_head (base_train.py get_scaling_params)."""
        return count_scaling_params(nnx.state(self, nnx.Param), self.config)

    def estimate_flops(self) -> int:
        """Training FLOPs per token: 6 x the matmul weights (not wte, the value embeddings or the lambdas)
        + attention's 12*H*D*window per layer (estimate_flops)."""
        return estimate_flops(self.config)


def use_fp8(model: nnx.Module, enabled: bool = True) -> tuple[int, int]:
    """Switch the fp8 matmuls of a model's linear layers on or off: nanochat's convert_to_float8_training
    with base_train.py's filter (nanochat at 92d63d4; jaxchat.model.fp8.eligible), lm_head included (its loss
    head then runs in fp8, jaxchat.model.loss). The weights are untouched: evaluation and sampling switch fp8
    off on the same parameters, as nanochat's disable_fp8. Returns (layers in fp8, linear layers)."""
    layers = [node for _, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    for layer in layers:
        layer.fp8_enabled = enabled and fp8.eligible(layer.in_features, layer.out_features)
    return sum(layer.fp8_enabled for layer in layers), len(layers)


def abstract_model(config: GPTConfig, seed: int = 0, **model_kwargs) -> GPT:
    """The GPT's structure with ShapeDtypeStructs in place of arrays: no memory spent. Each call returns a
    model of its own (callers switch its fp8 on or off) from a trace of the constructor kept per process
    (0.03-0.07 s at d2, 0.35 s at d20 alone; a run asks 4-5 times)."""
    return nnx.merge(*_abstract_split(config, seed, **model_kwargs), copy=True)


@per_process_cache
def _abstract_split(config: GPTConfig, seed: int, **model_kwargs) -> tuple:
    return nnx.split(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(seed), **model_kwargs)))


def estimate_flops(config: GPTConfig) -> int:
    """Training FLOPs per token, nanochat's estimate: 6 x the weights of every matmul (the model's linear
    kernels, lm_head and the gates included; not wte nor the value embeddings, lookups, nor the lambdas)
    + 12 x heads x head_dim x window for each layer's attention scores and values."""
    model = abstract_model(config)
    matmul_params = sum(math.prod(node.kernel.shape) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Linear))
    return 6 * matmul_params + attention_flops_per_token(config)


def attention_flops_per_token(config: GPTConfig) -> int:
    """estimate_flops' attention term: forward and backward of the scores and values, 12 x heads x head_dim
    x window per layer (each token counted against its whole window, as nanochat does)."""
    return sum(12 * config.n_head * config.head_dim * min(w, config.sequence_len) for w in config.window_sizes())


def count_scaling_params(params: nnx.State, config: GPTConfig) -> int:
    """The parameter count the recipe's data:param ratio multiplies, of a GPT's parameters (or their shapes)."""
    if config.features.scaling_params == "all":
        return count_params(params)
    return count_params(params["blocks"]) + count_params(params["lm_head"])


def logical_axes(params: nnx.State) -> list[tuple[str, ...]]:
    """The logical axis names of every parameter, in leaf order, as the model declared them (jaxchat.distributed.mesh)."""
    return [v.get_metadata()["logical_axes"] for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def count_params(state) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))

