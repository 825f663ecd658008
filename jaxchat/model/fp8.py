"""fp8 training with dynamic tensorwise scaling: nanochat's recipe (nanochat/fp8.py at 92d63d4) in JAX.

A linear layer y = x @ w does three matmuls; each runs on fp8 operands, one float32 scale per operand:

    forward   y  = x @ w        x, w in e4m3 (max 448: more mantissa)
    dgrad     dx = g @ w^T      g in e5m2 (max 57344: more range), w in e4m3
    wgrad     dw = x^T @ g      x in e4m3, g in e5m2

Quantising a tensor t to an fp8 type with largest finite value M (nanochat's _to_fp8):

    amax  = max |t|                       (float32, the whole tensor: "tensorwise")
    scale = M / max(amax, 1e-12)          (float32)
    q     = fp8(clip(t * scale, -M, M))   (the clip saturates: a plain cast to e4m3fn turns 449 into NaN)
    inv   = 1 / scale                     (float32; the product is dequantised by inv_a * inv_b)

nanochat divides in float64 and rounds to float32; a float32 division of float32 operands is correctly
rounded and so gives the same value (double rounding is harmless for division when 53 >= 2 x 24 + 2).
An all-zero tensor has amax 0: scale 448e12 maps it to zeros and the product is exactly 0.

A non-finite operand poisons the whole product: an inf makes amax inf, scale 0 and inv inf; a NaN makes
amax, scale and inv NaN; either way every element of the result is NaN (0 x inf = NaN), never a finite
value saturated at M. So a step whose activations or gradients overflow gives a NaN loss that is seen at
once, rather than a quietly clipped update. (This relies on max propagating NaN: XLA's default; the
GPU flag xla_gpu_enable_fast_min_max=true would break it, and jaxchat.distributed.runtime does not set it.)

How this reaches the hardware: each dot_general below takes the fp8 arrays themselves (f8E4M3FN and
f8E5M2 operands in the lowered program) and multiplies its product by the one scalar inv_a * inv_b.
On Hopper, XLA's GPU GemmRewriter pass (xla/service/gpu/transforms/gemm_rewriter.cc, its FP8 path) turns
a dot with fp8 operands into a cuBLASLt fp8 GEMM custom call (`__cublas$lt$matmul$f8`) and folds the
scalar into the GEMM's scale operands and a bf16 cast into its output type (scaled_dot), as
torch._scaled_mm's scale_a/scale_b and out_dtype do in nanochat. The forward dot asks for DEFAULT
precision and the gradients' dots for HIGHEST, as flax.linen.fp8_ops does: an fp8 cuBLASLt GEMM uses
fast accumulation when both operands' precision is DEFAULT (openxla/xla#6599), so this is nanochat's
use_fast_accum=True forward and False backward. (XLA writes fp8 GEMMs only for a CUDA version it knows
allows them: a compile-only GPU target must declare one, see docs/benchmarks.md.)

The backward pass keeps what nanochat saves: the fp8 operands and their scales (remat 'dots' keeps the
bf16 result instead and recomputes them: jaxchat.model.gpt). In the data-parallel step each device scales its
own rows' activations and gradients, as each rank of nanochat's DDP does.

Why not Flax's or JAX's fp8 ops: flax.linen.fp8_ops scales with an amax history carried from step to
step ("delayed" scaling: extra state in the parameters, the optimizer and the checkpoint) and divides by
the scale instead of nanochat's multiply; jax.nn.scaled_matmul is block scaling (MXFP8, one e8m0 scale
per 32 values, cuDNN on Blackwell), not one scale per tensor on Hopper.
"""

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

E4M3 = jnp.float8_e4m3fn  # activations and weights
E5M2 = jnp.float8_e5m2  # gradients
AMAX_FLOOR = 1e-12  # nanochat's EPS: an all-zero tensor gets a finite scale
FORWARD_PRECISION = lax.Precision.DEFAULT  # cuBLASLt fast accumulation (nanochat: use_fast_accum=True)
BACKWARD_PRECISION = lax.Precision.HIGHEST  # full accumulation (nanochat: use_fast_accum=False)
MIN_DIM, DIM_MULTIPLE = 128, 16  # nanochat's filter (scripts/base_train.py at 92d63d4)
RECIPES = ("tensorwise",)  # nanochat's own fp8.py implements only this one
OUTPUT_NAME = "fp8_matmul_output"  # the dequantised result, for remat policies (jaxchat.model.gpt)


def eligible(fan_in: int, fan_out: int) -> bool:
    """nanochat's fp8_module_filter: both dimensions divisible by 16 (the fp8 GEMM's alignment on H100)
    and the smaller at least 128 (below that the quantisation costs more than the fp8 GEMM saves)."""
    return fan_in % DIM_MULTIPLE == 0 and fan_out % DIM_MULTIPLE == 0 and min(fan_in, fan_out) >= MIN_DIM


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """x in fp8 `dtype` with one dynamic scale for the whole tensor: (q, inv_scale), x ~ q * inv_scale."""
    fp8_max = float(jnp.finfo(dtype).max)
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32))
    scale = jnp.float32(fp8_max) / jnp.maximum(amax, jnp.float32(AMAX_FLOOR))
    q = jnp.clip(x32 * scale, -fp8_max, fp8_max).astype(dtype)
    return q, 1.0 / scale


def scaled_dot(a: jax.Array, inv_a: jax.Array, b: jax.Array, inv_b: jax.Array, contracting: tuple, out_dtype,
               precision) -> jax.Array:
    """The dequantised product of two fp8 operands, dot(a, b) x inv_a x inv_b, in out_dtype. `contracting`
    is ((a's dims), (b's dims)).

    A float32 result takes the float32 product times the float32 scale. A narrower one (bf16) is the
    dot's own output type with the scale rounded to it: XLA folds that scale into the cuBLASLt call, which
    writes bf16 once. (Seen in the step compiled for an H100: a float32 product with the scale applied
    after it stays a float32 GEMM output plus a separate convert pass over it, extra memory traffic of
    the order of the fp8 GEMM's own time at K of a few thousand, by the H100's datasheet figures.)
    The scale's bf16 rounding (at most 2^-9 relative, one factor for the whole product) is the size of
    bf16's own rounding of each result. The CPU differs here: XLA:CPU accumulates a bf16-result dot of
    fp8 operands with bf16 roundings (seen: 3.2e-3 relative error at K = 4096, more than one bf16
    rounding), where cuBLASLt accumulates in float32 whatever it writes; CPU runs compute in float32
    (jaxchat.common.compute_dtype), which takes the float32 path."""
    out_dtype = jnp.dtype(out_dtype)
    result_type = jnp.float32 if out_dtype.itemsize >= 4 else out_dtype
    product = lax.dot_general(a, b, (contracting, ((), ())), precision=precision, preferred_element_type=result_type)
    return checkpoint_name((product * (inv_a * inv_b).astype(result_type)).astype(out_dtype), OUTPUT_NAME)


def is_fp8_dot(prim, *avals, **params) -> bool:
    """Whether a primitive (as a remat policy sees it) is a dot_general on fp8 operands."""
    return prim is lax.dot_general_p and any(jnp.dtype(a.dtype).itemsize == 1 and jnp.issubdtype(a.dtype, jnp.floating)
                                             for a in avals)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., K) @ w (K, N) with all three matmuls in fp8; the result in x's dtype (the compute dtype),
    the weight's gradient in w's dtype (the float32 master weight is quantised directly, as nanochat's)."""
    y = _matmul_2d(x.reshape(-1, x.shape[-1]), w, jnp.dtype(w.dtype))
    return y.reshape(*x.shape[:-1], w.shape[1])


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_2d(x, w, w_dtype):
    return _matmul_2d_fwd(x, w, w_dtype)[0]


def _matmul_2d_fwd(x, w, w_dtype):
    qx, inv_x = quantize(x, E4M3)
    qw, inv_w = quantize(w, E4M3)
    y = scaled_dot(qx, inv_x, qw, inv_w, ((1,), (0,)), x.dtype, FORWARD_PRECISION)
    return y, (qx, inv_x, qw, inv_w)


def _matmul_2d_bwd(w_dtype, residuals, g):
    qx, inv_x, qw, inv_w = residuals
    qg, inv_g = quantize(g, E5M2)
    dx = scaled_dot(qg, inv_g, qw, inv_w, ((1,), (1,)), g.dtype, BACKWARD_PRECISION)  # (M, N) x (K, N)^T
    dw = scaled_dot(qx, inv_x, qg, inv_g, ((0,), (0,)), w_dtype, BACKWARD_PRECISION)  # (M, K)^T x (M, N)
    return dx, dw


_matmul_2d.defvjp(_matmul_2d_fwd, _matmul_2d_bwd)
