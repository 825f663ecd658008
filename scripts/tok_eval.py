"""Compression of the trained tokenizer, in bytes per token (higher is better), on training and validation
text and on a few fixed kinds of text; next to GPT-2's and GPT-4's tokenizers when tiktoken can load
them (they are downloaded once, so offline machines skip the comparison).

    python -m scripts.tok_eval [--no-compare]
"""

import argparse
import socket

import tiktoken

from jaxchat.common import fail
from jaxchat.data.shards import list_row_groups, read_row_group
from jaxchat.report import Label, Section, get_report
from jaxchat.data.tokenizer import TokenizerError, get_tokenizer

PROSE = """\
The lighthouse keeper kept a logbook for forty-one years. Most entries were short: the wind's direction,
the state of the sea, a ship sighted at dawn. But on winter nights, when storms shut the harbour, he wrote
at length about the birds that sheltered on the gallery rail, how the gulls arrived first and the small
brown wrens last, and how, by morning, they had all gone as quietly as they came. His granddaughter found
the books in a trunk after he died and read them aloud, one storm at a time."""

CODE = '''\
def merge_sorted(left: list[int], right: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list in O(len(left) + len(right))."""
    merged, i, j = [], 0, 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged

if __name__ == "__main__":
    print(merge_sorted([1, 4, 9], [2, 3, 10, 11]))  # [1, 2, 3, 4, 9, 10, 11]
'''

NUMBERS = """\
date,station,temp_c,rain_mm,wind_kmh
2024-01-03,4021,-3.5,0.0,17
2024-01-04,4021,-1.25,2.4,22
2024-01-05,4021,0.75,11.8,41
2024-01-06,4021,2.0,6.35,38
Total rainfall: 20.55 mm; mean temperature -0.5 C; 3.14159265358979; 1,234,567,890; 0xDEADBEEF; 1e-9"""

NON_ENGLISH = """\
Der Leuchtturmwärter führte einundvierzig Jahre lang ein Logbuch über Wind, Wetter und Schiffe.
Le gardien du phare tenait un journal : la direction du vent, l'état de la mer, un navire aperçu à l'aube.
灯台守は四十一年間、風向きや海の様子、夜明けに見えた船について日誌をつけていた。
등대지기는 사십일 년 동안 바람의 방향과 바다의 상태를 일지에 적었다.
Смотритель маяка сорок один год вёл журнал наблюдений за ветром и морем."""


def split_sample(split: str, min_chars: int = 1_000_000) -> str:
    """The first row groups of a split, up to about min_chars: enough for a stable ratio, quick to encode."""
    docs, num_chars = [], 0
    for path, row_group in list_row_groups(split, args.data_dir):
        new_docs = read_row_group(path, row_group)
        docs += new_docs
        num_chars += sum(map(len, new_docs))
        if num_chars >= min_chars:
            break
    return "\n".join(docs)


parser = argparse.ArgumentParser(description="Compression of the trained tokenizer, in bytes per token")
parser.add_argument("--no-compare", action="store_true",
                    help="leave out GPT-2's and GPT-4's tokenizers (tiktoken downloads them on first use)")
parser.add_argument("--download-timeout", type=float, default=10.0,
                    help="seconds to wait for those downloads before skipping the comparison (default 10)")
parser.add_argument("--data-dir", default=None, help="parquet shards (default: <base_dir>/base_data; recipe "
                    "92d63d4's ClimbMix: <base_dir>/base_data_climbmix)")
args = parser.parse_args()

texts = {
    "train": split_sample("train"),
    "val": split_sample("val"),
    "prose": PROSE,
    "code": CODE,
    "numbers": NUMBERS,
    "non-English": NON_ENGLISH,
}

try:
    ours = get_tokenizer()
except (FileNotFoundError, TokenizerError) as e:  # missing, or cut short
    fail(str(e))
encoders = {"ours": ours.encode}
baselines = {} if args.no_compare else {"GPT-2": "gpt2", "GPT-4": "cl100k_base"}
notes = []
socket.setdefaulttimeout(args.download_timeout)  # a firewall that drops packets must not hang the script
for label, encoding_name in baselines.items():
    try:
        encoders[label] = tiktoken.get_encoding(encoding_name).encode_ordinary
    except Exception as e:  # no network and no cached copy: tiktoken raises whatever requests raised
        notes.append(f"{label} comparison skipped: tiktoken could not load '{encoding_name}' "
                     f"({type(e).__name__}; it is downloaded on first use)")

for name, text in texts.items():
    if ours.decode(ours.encode(text)) != text:
        raise RuntimeError(f"round trip failed on the {name} text")

print(f"vocab size: {ours.get_vocab_size():,}")
header = f"{'text':<12} {'bytes':>10}" + "".join(f" {label + ' tok':>12} {'B/tok':>6}" for label in encoders)
print(header)
print("-" * len(header))
bytes_per_token = {}  # (text, encoder) -> bytes per token
table = ["| text | bytes | " + " | ".join(f"{label} tokens | {label} B/tok" for label in encoders) + " |",
         "| --- " * (2 + 2 * len(encoders)) + "|"]  # the same table in markdown, for the report
for name, text in texts.items():
    num_bytes = len(text.encode("utf-8"))
    row = f"{name:<12} {num_bytes:>10,}"
    cells = [name, f"{num_bytes:,}"]
    for label, encode in encoders.items():
        num_tokens = len(encode(text))
        bytes_per_token[name, label] = num_bytes / max(num_tokens, 1)
        row += f" {num_tokens:>12,} {bytes_per_token[name, label]:>6.2f}"
        cells += [f"{num_tokens:,}", f"{bytes_per_token[name, label]:.2f}"]
    print(row)
    table.append("| " + " | ".join(cells) + " |")
for note in notes:
    print(note)

get_report().log(section=Section.TOKENIZER_EVALUATION, data=[
    {Label.VOCAB_SIZE: ours.get_vocab_size(), "train bytes/token": f"{bytes_per_token['train', 'ours']:.2f}",
     Label.VAL_BYTES_PER_TOKEN: f"{bytes_per_token['val', 'ours']:.2f}"},
    "\n".join(table),
    "\n".join(notes),
])
