"""nanochat's maths in float64 NumPy, written independently of jaxchat: the references the parity tests
compare against (Muon and its polar express, the GPT forward on nanochat's state dict).

Each takes `rnd`, applied wherever nanochat (PyTorch, bf16) rounds a result to bf16: the identity
gives the float64 reference; bf16_round gives an emulation of nanochat's own bf16 rounding, the
yardstick for jaxchat's bf16 errors. PyTorch computes each bf16 op in float32 (a Python-float
coefficient included) and rounds its result once; the products of bf16 matmul operands are exact in
float64 here and accumulate far more precisely than bf16 can hold, so float64 arithmetic followed by
one rounding per op stands for it.
"""

import math

import ml_dtypes
import numpy as np


def exact(a: np.ndarray) -> np.ndarray:
    return a


def bf16_round(a) -> np.ndarray:
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def rel_err(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def cosine(a, b) -> float:
    return float(np.vdot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


# Muon, in the PyTorch (rows, cols) = (out, in) layout of nanochat/muon.py; jaxchat's kernels are W.T.
POLAR_EXPRESS_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
# Bounds on jaxchat's bf16 Muon parameter changes against the float64 reference, for tests without a
# nanochat emulation of their own (tests/test_muon.py compares with one, case by case). Measured on
# tests/test_optim.py's tiny GPT over 10 steps: relative error 0.8-4.0% (most of it cautious-decay
# mask entries flipped by rounding, under its strong weight decay), cosine >= 0.9991.
BF16_REL_TOL = 0.06
BF16_MIN_COSINE = 0.998


def ref_polar_express(g: np.ndarray, rnd=exact) -> np.ndarray:
    """nanochat's polar express: X = g.bfloat16(), normalised, then X <- aX + (bA + cA²)X, A = XXᵀ."""
    transposed = g.shape[0] > g.shape[1]
    x = rnd(g.T if transposed else g)
    x = rnd(x / rnd(rnd(rnd(np.linalg.norm(x)) * 1.02) + 1e-6))
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = rnd(x @ x.T)
        B = rnd(rnd(b * A) + rnd(c * rnd(A @ A)))
        x = rnd(rnd(a * x) + rnd(B @ x))
    return x.T if transposed else x


def ref_muon_step(w, g, m, s2, lr, beta, beta2, wd, rnd=exact):
    """One Muon step on one PyTorch-layout matrix w (rows, cols) -> (w, m, s2). With rnd=bf16_round,
    nanochat's muon_step_fused: the orthogonalised update stays bf16, and beta2, the
    variance-reduction scale, lr and wd are rounded to bf16 before they are applied."""
    rows, cols = w.shape
    m = beta * m + (1 - beta) * g
    u = (1 - beta) * g + beta * m
    x = ref_polar_express(u, rnd)
    axis = 1 if rows >= cols else 0
    v = np.mean(x**2, axis=axis, keepdims=True)
    n = x.shape[axis]
    norm = np.sqrt(v.sum() * n)
    s2 = s2 + rnd(1 - rnd(beta2)) * (v - s2)  # lerp_(v, 1 - beta2)
    step = 1 / np.sqrt(np.maximum(s2, 1e-10))
    norm_new = np.sqrt((v * n * step**2).sum())
    x = rnd(x * rnd(step * norm / max(norm_new, 1e-10)))
    lr_eff = rnd(lr * max(1.0, rows / cols) ** 0.5)
    mask = x * w >= 0
    return w - (rnd(lr_eff * x) + rnd(lr_eff * rnd(wd)) * w * mask), m, s2


def ref_lr_multiplier(it, num_iterations, warmup_iters, warmdown_ratio, final_lr_frac):
    """base_train.py's get_lr_multiplier (warmup_iters: bdcc030's round(warmup_ratio·N), 92d63d4's --warmup-steps)."""
    warmdown_iters = round(warmdown_ratio * num_iterations)
    if it < warmup_iters:
        return (it + 1) / warmup_iters
    if it <= num_iterations - warmdown_iters:
        return 1.0
    progress = (num_iterations - it) / warmdown_iters
    return progress * 1.0 + (1 - progress) * final_lr_frac


def ref_second_moment(rows: int, cols: int) -> np.ndarray:
    return np.zeros((rows, 1) if rows >= cols else (1, cols))


def torch_matrices(kernel) -> list[np.ndarray]:
    """The PyTorch-layout matrices of one kernel leaf (several for a stacked layer axis)."""
    k = np.asarray(kernel, np.float64)
    return [m.T for m in k.reshape(-1, *k.shape[-2:])]


# The GPT, on nanochat's state dict (PyTorch (out, in) weights); with rnd=bf16_round, nanochat's bf16
# forward (CUDA autocast, wte stored in bf16, eager rounding of every op's result).
def randomized(config, seed: int = 0):
    """A GPT whose every parameter is random and O(1)-scaled, so that no part of the forward is a no-op
    (at init the projections are zero and x0_lambdas too). Drawn by NumPy into the model's abstract shapes:
    no program is compiled (an initialisation draws with threefry, ~2 s to compile for a small GPT)."""
    import jax
    from flax import nnx

    from jaxchat.model.gpt import abstract_model

    model = abstract_model(config)
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)

    def draw(x):
        scale, offset = (0.5, 1.0) if len(x.shape) == 1 else (1 / math.sqrt(x.shape[0]), 0.0)
        return jax.numpy.asarray(rng.standard_normal(x.shape) * scale + offset, x.dtype)

    nnx.update(model, jax.tree.map(draw, state))
    return model


# What the GPT's maths takes from each nanochat commit (nanochat/gpt.py there): rotary base, whether its
# cos/sin table is bf16 whatever the compute dtype (bdcc030's `.bfloat16()`; 92d63d4's `.to(COMPUTE_DTYPE)`
# is float32 in a float32 run), the factor on q and k after the QK norm, and the short (S) window for a sequence
# length. Which layers have value embeddings, and whether there is a smear and a backout, the state dict's
# names say, as nanochat's modules.
NANOCHAT_MATHS = {
    "bdcc030": {"rotary_base": 10000, "bf16_table": True, "qk_scale": 1.0, "short_window": lambda T: T // 2},
    "92d63d4": {"rotary_base": 100000, "bf16_table": False, "qk_scale": 1.2,
                "short_window": lambda T: -(-T // 4 // 128) * 128},
}


def np_forward(sd: dict, config, idx: np.ndarray, rnd=exact, recipe: str = "bdcc030") -> np.ndarray:
    """Logits of nanochat's GPT (nanochat/gpt.py at that recipe's commit) in float64 NumPy."""
    eps = np.finfo(np.float32).eps  # F.rms_norm(eps=None): float32's epsilon, for bf16 inputs too
    maths = NANOCHAT_MATHS[recipe]

    def rms(x):
        return rnd(x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))

    def linear(x, name):
        return rnd(rnd(x) @ rnd(W(name)).T)

    def sigmoid(x):
        return rnd(1 / (1 + np.exp(-x)))

    B, T = idx.shape
    H, Hkv, D, C = config.n_head, config.n_kv_head, config.n_embd // config.n_head, config.n_embd
    inv_freq = (1.0 / (maths["rotary_base"] ** (np.arange(0, D, 2, dtype=np.float32) / D))).astype(np.float32)
    angles = np.arange(T, dtype=np.float32)[:, None] * inv_freq[None, :]  # float32 as nanochat's table
    table = bf16_round if maths["bf16_table"] else rnd  # in the compute dtype at 92d63d4: bf16 where rnd rounds
    cos, sin = table(np.cos(angles.astype(np.float64))), table(np.sin(angles.astype(np.float64)))

    def rotary(x):  # (B, T, h, D)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return np.concatenate([rnd(rnd(x1 * c) + rnd(x2 * s)), rnd(rnd(-x1 * s) + rnd(x2 * c))], axis=-1)

    pattern = config.window_pattern
    windows = [config.sequence_len if pattern[i % len(pattern)] == "L" else maths["short_window"](config.sequence_len)
               for i in range(config.n_layer)]
    windows[-1] = config.sequence_len
    W = lambda name: sd[name].astype(np.float64)  # noqa: E731
    x = rms(rnd(W("transformer.wte.weight"))[idx])
    if "smear_lambda" in sd:  # x_t += smear_lambda sigmoid(smear_gate(x_t[:24])) x_{t-1}, from position 1
        gate = rnd(rnd(W("smear_lambda")) * sigmoid(linear(x[:, 1:, :24], "smear_gate.weight")))
        x = np.concatenate([x[:, :1], rnd(x[:, 1:] + rnd(gate * x[:, :-1]))], axis=1)
    x0, x_mid = x, None
    i_pos, j_pos = np.arange(T)[:, None], np.arange(T)[None, :]
    for layer in range(config.n_layer):
        p = f"transformer.h.{layer}."
        x = rnd(rnd(W("resid_lambdas")[layer] * x) + rnd(W("x0_lambdas")[layer] * x0))
        h = rms(x)
        q = linear(h, p + "attn.c_q.weight").reshape(B, T, H, D)
        k = linear(h, p + "attn.c_k.weight").reshape(B, T, Hkv, D)
        v = linear(h, p + "attn.c_v.weight").reshape(B, T, Hkv, D)
        if f"value_embeds.{layer}.weight" in sd:  # v += 3 sigmoid(ve_gate(h[:12])) ve, per key/value head
            ve = rnd(W(f"value_embeds.{layer}.weight"))[idx].reshape(B, T, Hkv, D)
            gate = rnd(3 * sigmoid(linear(h[..., :12], p + "attn.ve_gate.weight")))
            v = rnd(v + rnd(gate[..., None] * ve))
        q, k = rms(rotary(q)), rms(rotary(k))
        if maths["qk_scale"] != 1.0:
            q, k = rnd(q * maths["qk_scale"]), rnd(k * maths["qk_scale"])
        k, v = np.repeat(k, H // Hkv, axis=2), np.repeat(v, H // Hkv, axis=2)
        scores = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)  # softmax in float32: not rounded
        allowed = (i_pos - j_pos >= 0) & (i_pos - j_pos <= windows[layer])
        scores = np.where(allowed, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        y = rnd(np.einsum("bhts,bshd->bthd", rnd(probs), v)).reshape(B, T, C)
        x = rnd(x + linear(y, p + "attn.c_proj.weight"))
        hidden = rnd(np.maximum(linear(rms(x), p + "mlp.c_fc.weight"), 0) ** 2)
        x = rnd(x + linear(hidden, p + "mlp.c_proj.weight"))
        if layer == config.n_layer // 2:
            x_mid = x
    if "backout_lambda" in sd:  # the mid-layer residual subtracted before the final norm
        x = rnd(x - rnd(rnd(W("backout_lambda")) * x_mid))
    logits = linear(rms(x), "lm_head.weight")[..., : config.vocab_size]  # then .float() for the softcap
    return 15 * np.tanh(logits / 15)
