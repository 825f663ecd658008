"""Bits per byte against a hand computation in float64: bpb = sum of the losses (nats) of the targets
that are >= 0 and have token_bytes > 0, over ln 2 x the bytes of those targets (nanochat/loss_eval.py)."""

import math

import numpy as np
import pytest
from compiled import forward, new_model

from jaxchat.eval import bpb as loss_eval
from jaxchat.model.gpt import GPT, GPTConfig
from jaxchat.eval.bpb import evaluate_bpb
from jaxchat.distributed.mesh import batch_sharding, make_mesh, put_batch

CONFIG = GPTConfig(sequence_len=8, vocab_size=50, n_layer=2, n_head=2, n_kv_head=1, n_embd=16, window_pattern="SL")
BOS, OTHER_SPECIAL = 48, 49  # special tokens come after the merges and stand for no text: 0 bytes
SPECIALS = (BOS, OTHER_SPECIAL)


def model_with_random_head(seed: int) -> GPT:
    """lm_head at init is nearly zero; a random one makes every position's loss different."""
    model = new_model(CONFIG, seed)
    model.lm_head.kernel[...] = np.random.default_rng(seed).standard_normal(model.lm_head.kernel.shape, np.float32)
    return model


def make_token_bytes() -> np.ndarray:
    token_bytes = np.random.default_rng(0).integers(1, 7, CONFIG.vocab_size).astype(np.int32)
    token_bytes[list(SPECIALS)] = 0
    return token_bytes


def make_batches(num: int, rows: int = 16, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows with BOS and another special token among the targets, and some ignored targets (-1)."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(num):
        tokens = rng.integers(0, CONFIG.vocab_size, (rows, CONFIG.sequence_len + 1)).astype(np.int32)
        tokens[:, 0] = BOS
        tokens[rng.random(tokens.shape) < 0.15] = BOS
        tokens[rng.random(tokens.shape) < 0.1] = OTHER_SPECIAL
        targets = tokens[:, 1:].copy()
        targets[rng.random(targets.shape) < 0.2] = -1
        batches.append((tokens[:, :-1], targets))
    return batches


def hand_bpb(model: GPT, batches, token_bytes) -> float:
    nats, num_bytes = 0.0, 0
    for inputs, targets in batches:
        logits = np.asarray(forward(model, inputs), np.float64)  # (B, T, V)
        for b in range(inputs.shape[0]):
            for t in range(inputs.shape[1]):
                y = int(targets[b, t])
                if y < 0 or token_bytes[y] == 0:
                    continue
                row = logits[b, t]
                nats += math.log(np.exp(row - row.max()).sum()) + row.max() - row[y]
                num_bytes += int(token_bytes[y])
    return nats / (math.log(2) * num_bytes)


def test_bpb_matches_hand_computation():
    model, token_bytes, batches = model_with_random_head(0), make_token_bytes(), make_batches(3)
    expected = hand_bpb(model, batches, token_bytes)
    # float32 per-token losses (~4) summed on device over a batch's ~100 text targets: ~log2(100) eps32
    # relative (1e-6); the float64 reference reads the same logits. rel=1e-5 leaves 10x.
    assert evaluate_bpb(model, iter(batches), 3, token_bytes) == pytest.approx(expected, rel=1e-5)
    # only the first `steps` batches count
    assert evaluate_bpb(model, iter(batches), 2, token_bytes) == pytest.approx(
        hand_bpb(model, batches[:2], token_bytes), rel=1e-5)


def test_bpb_takes_batches_already_on_the_mesh():
    model, token_bytes, batches = model_with_random_head(1), make_token_bytes(), make_batches(2)
    mesh = make_mesh()
    sharding = batch_sharding(mesh, ndim=2)
    placed = [(put_batch(x, sharding), put_batch(y, sharding)) for x, y in batches]
    assert tuple(placed[0][0].sharding.spec) == ("data", None) and len(placed[0][0].sharding.device_set) == 8
    assert evaluate_bpb(model, placed, 2, token_bytes, mesh) == pytest.approx(
        hand_bpb(model, batches, token_bytes), rel=1e-5)


def test_no_bytes_gives_inf():
    model, token_bytes = model_with_random_head(0), make_token_bytes()
    inputs, targets = make_batches(1)[0]
    only_specials = np.where(targets >= 0, BOS, -1).astype(np.int32)
    assert evaluate_bpb(model, [(inputs, only_specials)], 1, token_bytes) == float("inf")
    assert evaluate_bpb(model, [], 0, token_bytes) == float("inf")


def test_new_parameters_do_not_recompile():
    token_bytes, batches = make_token_bytes(), make_batches(1)
    loss_eval._batch_sums.clear_cache()
    first = evaluate_bpb(model_with_random_head(0), batches, 1, token_bytes)
    second = evaluate_bpb(model_with_random_head(1), batches, 1, token_bytes)
    assert first != second
    assert loss_eval._batch_sums._cache_size() == 1


def test_running_out_of_batches_is_an_error():
    with pytest.raises(ValueError, match="ran out after 1 of 2 steps"):
        evaluate_bpb(model_with_random_head(0), make_batches(1), 2, make_token_bytes())
