"""The KV-cache engine against generation by re-running the full forward, and its sampling rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from compiled import forward
from nanochat_numpy import randomized

from jaxchat.model import engine as engine_module
from jaxchat.model.engine import Engine
from jaxchat.model.gpt import GPT, GPTConfig
from jaxchat.data.tokenizer import Tokenizer

# windows: 6, 6 and 12 (the last layer is always full); prompts below are longer than 6
CONFIG = GPTConfig(sequence_len=12, vocab_size=300, n_layer=3, n_head=2, n_kv_head=1, n_embd=32, window_pattern="S")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    text = "the quick brown fox jumps over the lazy dog and the cat sat on the mat " * 20
    return Tokenizer.train_from_iterator(iter([text]), 300)


@pytest.fixture(scope="module")
def model() -> GPT:
    """Every parameter random and O(1) (at init the projections are zero), so every layer matters."""
    return randomized(CONFIG, seed=1)


def greedy_by_full_forward(model: GPT, prompt: list[int], max_tokens: int, length: int = 48) -> list[int]:
    """Re-run the whole sequence every token. It is padded on the right to a fixed length (one
    compilation): causal attention keeps the padding out of every earlier position's logits.

    The engine computes the same logits through other programs (prefill, cached decode), which round
    differently by a few eps32 of their scale (logits up to ~4 here: ~1e-6): their argmax is only the same
    where the best logit leads the next by more than that. Each pick must lead by 1e-3 (the smallest lead
    here is 8e-3), so the comparison cannot hinge on a machine's rounding."""
    forward = jax.jit(lambda idx: model(idx))
    tokens = list(prompt)
    for _ in range(max_tokens):
        padded = np.zeros((1, length), np.int32)
        padded[0, : len(tokens)] = tokens
        logits = np.asarray(forward(padded)[0, len(tokens) - 1])
        second, first = np.sort(logits)[-2:]
        assert first - second > 1e-3, "the fixture must not sit on a float32 tie"
        tokens.append(int(np.argmax(logits)))
    return tokens


PROMPTS = [[3, 17, 42, 99, 5, 8, 250, 7, 61, 33], [299, 1, 2], [12] * 20]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_with_the_cache_equals_the_full_forward(model, tokenizer, prompt):
    """Prompts longer than the short window, generation past the training length (positions > 12)."""
    eng = Engine(model, tokenizer, stop_tokens=set())
    expected = greedy_by_full_forward(model, prompt, 14)
    results, masks = eng.generate_batch(prompt, num_samples=2, max_tokens=14, temperature=0.0)
    assert results == [expected, expected]
    assert masks == [[0] * len(prompt) + [1] * 14] * 2


def test_one_compilation_serves_prompts_of_different_lengths(model, tokenizer):
    engine_module._prefill.clear_cache()
    engine_module._decode_step.clear_cache()
    eng = Engine(model, tokenizer, stop_tokens=set())
    for prompt in ([5, 6], [7] * 9, [8] * 15):  # all pad to a 16-token prefill and a 64-slot cache
        eng.generate_batch(prompt, max_tokens=16, temperature=0.0)
    assert engine_module._prefill._cache_size() == 1
    assert engine_module._decode_step._cache_size() == 1


def test_top_k_1_equals_greedy(model, tokenizer):
    eng = Engine(model, tokenizer, stop_tokens=set())
    greedy, _ = eng.generate_batch(PROMPTS[0], num_samples=3, max_tokens=10, temperature=0.0)
    top1, _ = eng.generate_batch(PROMPTS[0], num_samples=3, max_tokens=10, temperature=1.5, top_k=1, seed=7)
    assert top1 == greedy


def test_a_seed_fixes_the_samples(model, tokenizer):
    eng = Engine(model, tokenizer, stop_tokens=set())
    kwargs = dict(num_samples=4, max_tokens=12, temperature=1.0)
    first, _ = eng.generate_batch(PROMPTS[1], seed=3, **kwargs)
    assert eng.generate_batch(PROMPTS[1], seed=3, **kwargs)[0] == first
    assert eng.generate_batch(PROMPTS[1], seed=4, **kwargs)[0] != first
    assert len({tuple(row) for row in first}) == 4  # the samples of one prompt differ from each other


@pytest.mark.parametrize("top_k", [None, 5])
def test_first_tokens_follow_the_tempered_distribution(model, tokenizer, top_k):
    """4000 samples of one token: frequencies match softmax(logits / T) over the top_k tokens, every
    row drawing on its own (nanochat gives every row the same first token)."""
    n, temperature = 4000, 0.7
    eng = Engine(model, tokenizer, stop_tokens=set())
    samples, _ = eng.generate_batch(PROMPTS[0], num_samples=n, max_tokens=1, temperature=temperature, top_k=top_k)
    counts = np.bincount([row[-1] for row in samples], minlength=CONFIG.vocab_size)
    logits = np.asarray(forward(model, jnp.asarray([PROMPTS[0]]))[0, -1], np.float64) / temperature
    if top_k is not None:
        logits[np.argsort(logits)[:-top_k]] = -np.inf
    p = np.exp(logits - logits.max())
    p /= p.sum()
    assert counts[p == 0].sum() == 0
    assert np.all(np.abs(counts / n - p) <= 5 * np.sqrt(p * (1 - p) / n) + 1e-9)
    assert (p > 0.01).sum() >= 3  # the test distribution is not a near-certainty


def test_rows_stop_at_a_stop_token(model, tokenizer):
    full, _ = Engine(model, tokenizer, stop_tokens=set()).generate_batch(PROMPTS[0], max_tokens=12, temperature=0.0)
    generated = full[0][len(PROMPTS[0]):]
    stop = generated[4]
    first = generated.index(stop)
    eng = Engine(model, tokenizer, stop_tokens={stop})
    results, masks = eng.generate_batch(PROMPTS[0], num_samples=2, max_tokens=12, temperature=0.0)
    assert results == [PROMPTS[0] + generated[:first]] * 2
    columns = list(eng.generate(PROMPTS[0], max_tokens=12, temperature=0.0))
    assert len(columns) == first + 1  # generation ends once every row has stopped


def test_default_stop_tokens_are_bos_and_assistant_end(model, tokenizer):
    eng = Engine(model, tokenizer)
    assert eng.stop_tokens == {tokenizer.get_bos_token_id(), tokenizer.encode_special("<|assistant_end|>")}


def test_without_max_tokens_generation_fills_the_training_length(model, tokenizer):
    columns = list(Engine(model, tokenizer, stop_tokens=set()).generate([1, 2, 3], temperature=0.0))
    assert len(columns) >= CONFIG.sequence_len


def test_bad_arguments_say_what_is_wrong(model, tokenizer):
    eng = Engine(model, tokenizer)
    with pytest.raises(ValueError, match="non-empty list"):
        list(eng.generate([], max_tokens=2))
    with pytest.raises(ValueError, match="temperature"):
        list(eng.generate([1], temperature=-1.0))
    with pytest.raises(ValueError, match="top_k"):
        list(eng.generate([1], top_k=0))
    with pytest.raises(ValueError, match="no room"):
        list(eng.generate([1] * 200, max_tokens=1))
