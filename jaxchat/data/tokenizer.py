"""Byte-level BPE in the style of GPT-4: trained with rustbpe, run with tiktoken.

Saved as plain text, never pickle, so loading a tokenizer cannot execute code:
  tokenizer.tiktoken  merge ranks, one "<base64 token bytes> <rank>" per line (tiktoken's rank format)
  tokenizer.json      split pattern and special tokens with their ids
  token_bytes.npy     raw byte length of every token id (0 for special tokens), for bits per byte
"""

import base64
import io
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np
import rustbpe
import tiktoken

from jaxchat import storage
from jaxchat.common import base_dir_hint, get_base_dir

SPECIAL_TOKENS = [
    "<|bos|>",  # every document starts with it; the only one pretraining uses
    "<|user_start|>",  # the rest delimit chat turns and tool calls at finetuning time
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
]
BOS = "<|bos|>"

# GPT-4's pattern, except numbers split into groups of 1-2 digits (not 1-3), which spends fewer
# merges on numbers at small vocabulary sizes.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

TOKENIZER_SUBDIR = "tokenizer"  # under a base dir, jaxchat's and nanochat's alike
RANKS_FILE = "tokenizer.tiktoken"
CONFIG_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
TRAIN_COMMAND = "python -m scripts.tok_train"


class TokenizerError(ValueError):
    """A tokenizer file that is there but cannot be read (cut short, edited): the message names it and what to do."""


def _unreadable(path: str, reason: str) -> TokenizerError:
    return TokenizerError(
        f"{path} cannot be read ({reason}): restore it from a copy of this tokenizer, or train a new one with "
        f"`{TRAIN_COMMAND}` (checkpoints trained with the old one will not load with a new one)")


class Tokenizer:
    """tiktoken encoding built from merge ranks (token bytes -> rank = id) plus special tokens after them."""

    def __init__(self, mergeable_ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN,
                 special_tokens: Sequence[str] = SPECIAL_TOKENS):
        num_merged = len(mergeable_ranks)
        # Ids are the ranks, so they must be exactly 0..n-1 for token_bytes and the embedding table.
        if sorted(mergeable_ranks.values()) != list(range(num_merged)):
            raise ValueError("merge ranks must be exactly 0..n-1 with no gaps or repeats")
        self.mergeable_ranks = mergeable_ranks
        self.pattern = pattern
        self.special_tokens = {name: num_merged + i for i, name in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(name="jaxchat", pat_str=pattern, mergeable_ranks=mergeable_ranks,
                                     special_tokens=self.special_tokens)
        self.bos_token_id = self.encode_special(BOS)

    @classmethod
    def train_from_iterator(cls, text_iterator: Iterable[str], vocab_size: int) -> "Tokenizer":
        """BPE on the texts; vocab_size counts the 256 bytes, the merges and the special tokens (as nanochat).
        A corpus with too few distinct pairs stops early, giving a smaller vocabulary."""
        num_ranks = vocab_size - len(SPECIAL_TOKENS)
        if num_ranks < 256:
            raise ValueError(f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} "
                             f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens), got {vocab_size}")
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter(text_iterator), num_ranks, pattern=SPLIT_PATTERN)
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        return cls(ranks, trainer.get_pattern())

    # --- vocabulary -------------------------------------------------------------------------------

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_special_tokens(self) -> list[str]:
        return list(self.special_tokens)

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode_special(self, name: str) -> int:
        if name not in self.special_tokens:
            raise ValueError(f"unknown special token {name!r}; known: {', '.join(self.special_tokens)}")
        return self.special_tokens[name]

    def id_to_token(self, token_id: int) -> str:
        """The token as text (a lone piece of a multi-byte character shows as U+FFFD)."""
        return self.enc.decode([token_id])

    def token_bytes(self) -> np.ndarray:
        """int32 [vocab_size]: raw bytes per token id, straight from the merge table (decoding would count
        a partial UTF-8 sequence as the 3-byte replacement character); 0 for special tokens."""
        lengths = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self.mergeable_ranks.items():
            lengths[rank] = len(token)
        return lengths

    # --- encoding ---------------------------------------------------------------------------------

    def _special_id(self, token: str | int) -> int:
        return int(token) if isinstance(token, (int, np.integer)) else self.encode_special(token)

    def encode(self, text: str | list[str], prepend: str | int | None = None, append: str | int | None = None,
               num_threads: int = 8) -> list[int] | list[list[int]]:
        """A str gives list[int]; a list of str gives list[list[int]], encoded on num_threads threads.
        prepend/append: a special token name or an id, added to each text. Special-token text inside
        the input is encoded as ordinary text, never as the special token."""
        head = [self._special_id(prepend)] if prepend is not None else []
        tail = [self._special_id(append)] if append is not None else []
        if isinstance(text, str):
            return head + self.enc.encode_ordinary(text) + tail
        if isinstance(text, list):
            rows = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
            if head or tail:
                rows = [head + row + tail for row in rows]
            return rows
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    __call__ = encode

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        if not isinstance(ids, list):  # numpy / jax arrays, tuples
            ids = np.asarray(ids).tolist()
        return self.enc.decode(ids)

    # --- save / load --------------------------------------------------------------------------------

    def save(self, tokenizer_dir: str) -> None:
        """Write ranks, config and token_bytes; each to a temporary name first, so a crash never leaves
        a half-written tokenizer that loads."""
        storage.makedirs(tokenizer_dir)
        by_rank = sorted(self.mergeable_ranks.items(), key=lambda item: item[1])
        ranks_text = "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in by_rank)
        config = {"pattern": self.pattern, "special_tokens": self.special_tokens,
                  "vocab_size": self.get_vocab_size()}
        storage.write_bytes(storage.join(tokenizer_dir, RANKS_FILE), ranks_text.encode("ascii"))
        storage.write_bytes(storage.join(tokenizer_dir, CONFIG_FILE), (json.dumps(config, indent=2) + "\n").encode())
        token_bytes_npy = io.BytesIO()
        np.save(token_bytes_npy, self.token_bytes(), allow_pickle=False)
        storage.write_bytes(storage.join(tokenizer_dir, TOKEN_BYTES_FILE), token_bytes_npy.getvalue())

    @classmethod
    def load(cls, tokenizer_dir: str) -> "Tokenizer":
        ranks_path, config_path = storage.join(tokenizer_dir, RANKS_FILE), storage.join(tokenizer_dir, CONFIG_FILE)
        for path in (ranks_path, config_path):
            if not storage.exists(path):
                raise FileNotFoundError(f"no tokenizer at {tokenizer_dir} ({os.path.basename(path)} is missing)"
                                        f"{base_dir_hint(path)}; train one with `{TRAIN_COMMAND}`")
        try:
            config = json.loads(storage.read_text(config_path))
            names = sorted(config["special_tokens"], key=config["special_tokens"].get)
            pattern = config["pattern"]
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # cut short or edited: not our JSON
            raise _unreadable(config_path, f"{type(e).__name__}: {e}") from None
        ranks = _read_ranks(ranks_path)
        if not ranks:
            raise _unreadable(ranks_path, "it holds no merge ranks")
        try:
            tokenizer = cls(ranks, pattern, names)
        except ValueError as e:  # ranks that are not 0..n-1: a file cut mid-line
            raise _unreadable(ranks_path, str(e)) from None
        # Special ids are implied by their order after the merges: a ranks file cut at a line's end disagrees
        if tokenizer.special_tokens != config["special_tokens"]:
            raise _unreadable(ranks_path, f"{len(ranks)} merge ranks, but {config_path} numbers its special tokens "
                                         "after another count")
        return tokenizer


def _read_ranks(path: str) -> dict[bytes, int]:
    # Our own reader: tiktoken's load_tiktoken_bpe caches files by path in a temp dir, so a retrained
    # tokenizer saved to the same path would silently load the old ranks.
    ranks = {}
    for line_number, line in enumerate(storage.read_bytes(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise _unreadable(path, f"line {line_number} is not a '<base64> <rank>' line: {line[:80]!r}") from None
    return ranks


def default_tokenizer_dir() -> str:
    return storage.join(get_base_dir(), TOKENIZER_SUBDIR)


def get_tokenizer(tokenizer_dir: str | None = None) -> Tokenizer:
    """The trained tokenizer from <base_dir>/tokenizer (or tokenizer_dir)."""
    return Tokenizer.load(tokenizer_dir or default_tokenizer_dir())


def get_token_bytes(tokenizer_dir: str | None = None) -> np.ndarray:
    """int32 [vocab_size]: raw bytes per token id, 0 for special tokens (for bits per byte)."""
    path = storage.join(tokenizer_dir or default_tokenizer_dir(), TOKEN_BYTES_FILE)
    if not storage.exists(path):
        raise FileNotFoundError(f"{path} is missing{base_dir_hint(path)}; train the tokenizer with `{TRAIN_COMMAND}`")
    try:
        return np.load(io.BytesIO(storage.read_bytes(path)), allow_pickle=False)
    except (ValueError, EOFError) as e:  # cut short: numpy says how much of the array it found
        raise _unreadable(path, f"{type(e).__name__}: {e}") from None
