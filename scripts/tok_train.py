"""Train the BPE tokenizer on the training shards and save it to <base_dir>/tokenizer.

    python -m scripts.tok_train --max-chars 2000000000 --vocab-size 65536    (the speedrun's choice)
"""

import argparse
import os
import time
from collections.abc import Iterator

from jaxchat import storage
from jaxchat.common import Progress
from jaxchat.data.shards import list_row_groups, read_row_group
from jaxchat.report import Label, Section, get_report
from jaxchat.data.tokenizer import SPECIAL_TOKENS, Tokenizer, default_tokenizer_dir

parser = argparse.ArgumentParser(description="Train a byte-level BPE tokenizer on the training shards")
parser.add_argument("--max-chars", type=int, default=10_000_000_000, help="stop after this many characters")
parser.add_argument("--doc-cap", type=int, default=10_000, help="use at most this many characters of a document")
parser.add_argument("--vocab-size", type=int, default=65536,
                    help=f"tokens in all: 256 bytes + merges + {len(SPECIAL_TOKENS)} special tokens")
parser.add_argument("--data-dir", default=None, help="parquet shards to train on (default: <base_dir>/base_data; "
                    "recipe 92d63d4's ClimbMix: <base_dir>/base_data_climbmix)")
args = parser.parse_args()
print(f"max_chars: {args.max_chars:,}  doc_cap: {args.doc_cap:,}  vocab_size: {args.vocab_size:,}")


def text_iterator(row_groups: list[tuple[str, int]], progress: Progress) -> Iterator[str]:
    """Documents of the training split in order, each cropped to doc_cap, until max_chars."""
    num_chars, num_docs, start = 0, 0, time.monotonic()
    shard_number = {path: i + 1 for i, path in enumerate(dict.fromkeys(path for path, _ in row_groups))}
    for i, (path, row_group) in enumerate(row_groups):
        for doc in read_row_group(path, row_group):
            doc = doc[:args.doc_cap]
            num_chars += len(doc)
            num_docs += 1
            yield doc
            if num_chars >= args.max_chars:
                progress.line(f"read {num_docs:,} documents, {num_chars:,} characters (max_chars reached)")
                return
        rate = num_chars / max(time.monotonic() - start, 1e-9) / 1e6
        progress.status(f"read {num_chars:,} of at most {args.max_chars:,} characters "
                        f"(shard {shard_number[path]}/{len(shard_number)}, {rate:.1f}M chars/s)")
        if i + 1 == len(row_groups) or row_groups[i + 1][0] != path:
            progress.line(f"{os.path.basename(path)} read: {num_docs:,} documents, {num_chars:,} characters so far")
    progress.line(f"read all {len(shard_number)} training shards: {num_docs:,} documents, {num_chars:,} characters")


row_groups = list_row_groups("train", args.data_dir)
progress = Progress()
t0 = time.time()
tokenizer = Tokenizer.train_from_iterator(text_iterator(row_groups, progress), args.vocab_size)
train_time = time.time() - t0
progress.close(f"training time: {train_time:.2f}s")
if tokenizer.get_vocab_size() < args.vocab_size:
    print(f"note: the corpus ran out of pairs to merge; vocabulary is {tokenizer.get_vocab_size():,}, "
          f"not {args.vocab_size:,}")

# The round trip must be exact on every kind of text, whatever the training data held.
sample = "Hello world! Numbers: 123, 4567.\nContractions: I'm, you're.\tSymbols: @#$%^&*()\nUnicode: 你好 🌍 e\u0301"
if tokenizer.decode(tokenizer.encode(sample)) != sample:
    raise RuntimeError("tokenizer round trip failed on the sanity sample")

tokenizer_dir = default_tokenizer_dir()
tokenizer.save(tokenizer_dir)
token_bytes = tokenizer.token_bytes()
regular = token_bytes[token_bytes > 0]
print(f"saved to {tokenizer_dir}: vocab_size {tokenizer.get_vocab_size():,} "
      f"({len(tokenizer.mergeable_ranks) - 256:,} merges + 256 bytes + {len(SPECIAL_TOKENS)} special)")
for name in sorted(storage.listdir(tokenizer_dir)):
    print(f"  {name}: {storage.size(storage.join(tokenizer_dir, name)):,} bytes")
print(f"token bytes: min {regular.min()}, max {regular.max()}, mean {regular.mean():.2f}, std {regular.std():.2f}")

get_report().log(section=Section.TOKENIZER_TRAINING, data=[
    vars(args),  # the command line
    {Label.VOCAB_SIZE: tokenizer.get_vocab_size(), "Training time": f"{train_time:.2f}s",
     "Special tokens": len(SPECIAL_TOKENS), "Token bytes (min / max / mean / std)":
     f"{regular.min()} / {regular.max()} / {regular.mean():.2f} / {regular.std():.2f}"},
])
