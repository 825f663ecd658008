"""Sampling from a GPT with its KV cache: the prompt is prefilled once, then every new token is one
jitted decode step that feeds a single token per row.

Shapes are bucketed so that prompts of different lengths reuse the same compiled functions: the
prompt is padded on the right to a power of two (its padding writes cache slots that the next steps
overwrite before anything attends to them), and the cache length is a power of two too. Several
samples from one prompt share its prefill: the cache is computed once and copied to every row.
"""

from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.model.gpt import ROTARY_LENGTH_FACTOR

MIN_PREFILL = 16  # the shortest padded prompt
MIN_CACHE = 64  # the shortest cache

# What nanochat's base_train / base_loss show, greedily and 16 tokens long, to eyeball a base model.
SAMPLE_PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
    "My favorite color is",
    "If 5*x + 3 = 13, then x is",
]


def _power_of_two_at_least(n: int, minimum: int) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def sample_next_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: int | None) -> jax.Array:
    """One token per row of logits (B, V): argmax when temperature is 0, else a draw from
    softmax(logits / temperature), restricted to the top_k most likely tokens when top_k is set."""
    greedy = jnp.argmax(logits, axis=-1)
    scale = jnp.where(temperature > 0, temperature, 1.0)  # keeps the unused sampling branch finite
    if top_k is None:
        sampled = jax.random.categorical(key, logits / scale, axis=-1)
    else:
        values, indices = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))
        choice = jax.random.categorical(key, values / scale, axis=-1)
        sampled = jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _prefill(graphdef, state, prompt, prompt_len, num_samples, cache_len, top_k, temperature, key):
    """prompt: (1, P) padded on the right; prompt_len: the real length. Returns the first sampled
    token of every row, the cache (num_samples rows, positions 0 .. prompt_len-1 filled) and the key."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.decode(prompt, model.init_cache(1, cache_len))
    last = jax.lax.dynamic_index_in_dim(logits, prompt_len - 1, axis=1, keepdims=False)  # (1, V)
    # Rewind over the padding: the next step writes at prompt_len, overwriting it.
    cache = model.rewind_cache(cache, prompt_len, prompt).repeat_rows(num_samples)
    key, subkey = jax.random.split(key)
    tokens = sample_next_token(jnp.repeat(last, num_samples, axis=0), subkey, temperature, top_k)
    return tokens, cache, key


@partial(jax.jit, static_argnums=(0, 3), donate_argnums=(2,))
def _decode_step(graphdef, state, cache, top_k, tokens, temperature, key):
    """Feed one token per row (B,); return the next token of every row, the cache one longer, the key."""
    logits, cache = nnx.merge(graphdef, state).decode(tokens[:, None], cache)
    key, subkey = jax.random.split(key)
    return sample_next_token(logits[:, -1], subkey, temperature, top_k), cache, key


def default_stop_tokens(tokenizer) -> list[int]:
    """Where a sample ends: BOS (a new document begins) and <|assistant_end|> (a chat turn ends), if the
    tokenizer has it. The Hugging Face export's generation config stops at the same tokens."""
    stops = [tokenizer.get_bos_token_id()]
    if "<|assistant_end|>" in tokenizer.get_special_tokens():
        stops.append(tokenizer.encode_special("<|assistant_end|>"))
    return stops


class Engine:
    """Generation for a model with init_cache/decode (jaxchat's GPT). The tokenizer names the stop
    tokens: a row ends when it samples BOS or <|assistant_end|> (or any of stop_tokens, if given).
    With several processes, run it on all of them (the parameters span their devices) and print on one."""

    def __init__(self, model: nnx.Module, tokenizer, stop_tokens: set[int] | None = None):
        self.graphdef, self.state = nnx.split(model)
        self.config = model.config
        self.stop_tokens = set(default_stop_tokens(tokenizer) if stop_tokens is None else stop_tokens)

    def generate(self, tokens: list[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 42
                 ) -> Iterator[tuple[list[int], list[int]]]:
        """Yields, per step, the next token of every row and its mask (1: sampled; nanochat's format,
        where 0 marks tokens a tool forced). Runs until max_tokens, until every row has sampled a stop
        token, or until the cache is full (max_tokens None: up to the model's training length)."""
        if not tokens or not all(isinstance(t, (int, np.integer)) for t in tokens):
            raise ValueError("tokens must be a non-empty list of token ids (e.g. tokenizer.encode(text, prepend=bos))")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be at least 1 (or None for no limit), got {top_k}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be at least 1, got {num_samples}")
        prompt_len = len(tokens)
        limit = ROTARY_LENGTH_FACTOR * self.config.sequence_len
        wanted = prompt_len + (max_tokens if max_tokens is not None else self.config.sequence_len)
        cache_len = min(_power_of_two_at_least(wanted, MIN_CACHE), limit)
        if prompt_len >= cache_len:
            raise ValueError(f"a prompt of {prompt_len} tokens leaves no room to generate within the model's "
                             f"{limit} positions")
        # Token n (from 0) is fed at position prompt_len + n to produce token n + 1.
        num_steps = min(max_tokens if max_tokens is not None else cache_len, cache_len - prompt_len + 1)
        if num_steps <= 0:
            return

        prompt = np.zeros((1, min(_power_of_two_at_least(prompt_len, MIN_PREFILL), cache_len)), np.int32)
        prompt[0, :prompt_len] = tokens
        temperature = jnp.float32(temperature)
        ids, cache, key = _prefill(self.graphdef, self.state, prompt, prompt_len, num_samples, cache_len, top_k,
                                   temperature, jax.random.key(seed))
        completed = [False] * num_samples
        for step in range(num_steps):
            # Queue the next step before reading this one back, so the device works while the host waits.
            if step + 1 < num_steps:
                next_ids, cache, key = _decode_step(self.graphdef, self.state, cache, top_k, ids, temperature, key)
            column = np.asarray(ids).tolist()
            yield column, [1] * num_samples
            completed = [done or token in self.stop_tokens for done, token in zip(completed, column)]
            if all(completed):
                return
            if step + 1 < num_steps:
                ids = next_ids

    def generate_batch(self, tokens: list[int], num_samples: int = 1, **kwargs) -> tuple[list[list[int]], list[list[int]]]:
        """(sequences, masks): each row's prompt followed by its generated tokens, the stop token left
        out; masks are 0 over the prompt and 1 over sampled tokens. kwargs as generate()."""
        results = [list(tokens) for _ in range(num_samples)]
        masks = [[0] * len(tokens) for _ in range(num_samples)]
        completed = [False] * num_samples
        for column, column_masks in self.generate(tokens, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if completed[i]:
                    continue
                if token in self.stop_tokens:
                    completed[i] = True
                else:
                    results[i].append(token)
                    masks[i].append(mask)
        return results, masks
