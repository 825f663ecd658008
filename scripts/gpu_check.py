"""
The checks and figures that need an NVIDIA GPU, in one run (the CPU test suite cannot reach the cuDNN
path). For a session that is lent a GPU:

    python -m scripts.gpu_check --json $OUT/gpu.json

1. cuDNN flash attention against the XLA path: outputs and gradients, bfloat16, for a sliding window,
   full causal attention and GQA. Fails (exit 1) if they disagree beyond bf16 rounding.
2. Attention alone, forward+backward, window T/2 against T: a short window must save time.
3. The whole train step (scripts.bench's measurement) of d12 with SSSL and L, and of d20: tok/s, MFU
   against the device's peak, peak memory.
Needs only jax, flax and optax (no grain, tokenizer or data).
"""

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxchat.attention import causal_attention
from scripts.bench import TRAIN_COLUMNS, bench_train, print_table

TOLERANCE = 2e-2  # relative to the output scale: a few bf16 ulps accumulated over the softmax


def attention_agreement(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, window: int) -> dict:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)

    def run(implementation):
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, window, implementation), q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *vjp(cotangent))]

    cudnn, xla = run("cudnn"), run("xla")
    errors = [float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)) for a, b in zip(cudnn, xla)]
    return {"case": f"B{batch} T{seq_len} H{heads}/{kv_heads} D{head_dim} window {window}",
            "out_rel_err": errors[0], "grad_rel_err": max(errors[1:]), "ok": max(errors) < TOLERANCE}


def attention_time(batch: int, seq_len: int, heads: int, head_dim: int, window: int, repeats: int = 20) -> float:
    q = k = v = jnp.ones((batch, seq_len, heads, head_dim), jnp.bfloat16)
    loss = lambda q, k, v: causal_attention(q, k, v, window, "cudnn").astype(jnp.float32).sum()  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready(step(q, k, v))
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(q, k, v)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--device-batch-size", type=int, default=16, help="rows per device in the train steps")
    parser.add_argument("--steps", type=int, default=10, help="timed train steps per configuration")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit(f"error: no GPU (JAX's backend is {jax.default_backend()}); this script checks the cuDNN path")
    device = jax.devices()[0]
    print(f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind}")

    agreement = [attention_agreement(2, 2048, 10, 10, 128, 1024), attention_agreement(2, 2048, 10, 10, 128, 2048),
                 attention_agreement(2, 2048, 8, 2, 128, 1024), attention_agreement(2, 1000, 6, 6, 64, 300)]
    print_table(agreement, [("case", "{}"), ("out_rel_err", "{:.2e}"), ("grad_rel_err", "{:.2e}"), ("ok", "{}")])

    half, full = attention_time(16, 2048, 10, 128, 1024), attention_time(16, 2048, 10, 128, 2048)
    windows = {"window_1024_ms": 1e3 * half, "window_2048_ms": 1e3 * full, "saving": 1 - half / full}
    print(f"attention fwd+bwd, B16 T2048 H10 D128: window 1024 {1e3 * half:.2f} ms, full {1e3 * full:.2f} ms "
          f"({windows['saving']:.0%} saved)")

    train = [bench_train(depth=depth, max_seq_len=2048, device_batch_size=args.device_batch_size,
                         vocab_size=65536, window_pattern=pattern, steps=args.steps)
             for depth, pattern in ((12, "SSSL"), (12, "L"), (20, "SSSL"))]
    print_table(train, TRAIN_COLUMNS)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": device.device_kind, "attention_agreement": agreement,
                       "attention_windows": windows, "train": train}, f, indent=2)
    if not all(row["ok"] for row in agreement):
        sys.exit("error: cuDNN attention disagrees with the XLA path beyond bf16 rounding (see the table)")


if __name__ == "__main__":
    main()
