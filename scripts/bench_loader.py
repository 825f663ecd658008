"""
Data loader throughput: training tokens per second delivered as (grad_accum, batch, T) batches, the
share of tokens cropped away by best-fit packing, the CPU it costs, and the size and restore time of
the loader's checkpoint state.

  python -m scripts.bench_loader                                  shards and tokenizer of the base dir
  python -m scripts.bench_loader --builtin --vocab-size 8192      no download: the built-in corpus and a
                                                                  tokenizer trained on it, in a temp dir
"""

import argparse
import json
import tempfile
import time

from jaxchat import dataset
from jaxchat.dataloader import make_train_loader
from jaxchat.tokenizer import Tokenizer, get_tokenizer

TARGET_TOKENS_PER_S = 1e6  # what a d20 run on 8 H100s consumes per host
FINEWEB_CROPPED_FRACTION = 0.35  # SPEC §7, nanochat's figure at T=2048 on FineWeb-Edu


def bench_loader(tokenizer, data_dir: str | None = None, *, seq_len: int = 2048, batch_size: int = 32,
                 grad_accum: int = 1, workers: int = 1, prefetch: int = 2, buffer_docs: int = 1000,
                 batches: int = 20, warmup: int = 2) -> dict:
    """Times `batches` batches after `warmup` (the first fills the document buffer). The loader runs
    flat out, so the rate is the producer's. cpu_cores is the process's CPU time over the wall time.

    Reading and tokenising is nearly all the work, so the CPU cost is counted per token read. The
    share cropped depends on the corpus (and on a small corpus, on how full of long documents the
    buffer has silted), so cores_for_target plans with FineWeb's: the cores to deliver
    TARGET_TOKENS_PER_S when FINEWEB_CROPPED_FRACTION of the tokens read are cropped away."""
    loader = make_train_loader(tokenizer, batch_size, seq_len, grad_accum, 0, 1, data_dir=data_dir,
                               buffer_docs=buffer_docs, workers=workers, prefetch=prefetch)
    start = time.perf_counter()
    next(loader)
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        next(loader)
    before = loader.get_state()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        inputs, _ = next(loader)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    state = loader.get_state()
    loader.close()

    # Restore cost: re-reading and re-tokenising the buffered documents, up to the next batch.
    resumed = make_train_loader(tokenizer, batch_size, seq_len, grad_accum, 0, 1, data_dir=data_dir,
                                buffer_docs=buffer_docs, workers=workers, prefetch=prefetch)
    restore_start = time.perf_counter()
    resumed.set_state(json.loads(json.dumps(state)))
    next(resumed)
    restore_s = time.perf_counter() - restore_start
    resumed.close()

    tokens = batches * inputs.size
    read = state["tokens_read"] - before["tokens_read"]
    packed = state["tokens_packed"] - before["tokens_packed"]
    cropped = state["tokens_cropped"] - before["tokens_cropped"]
    cpu_per_read_token = cpu / read
    return {
        "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum, "workers": workers,
        "tokens_per_s": tokens / wall,
        "read_per_s": read / wall,
        "cropped_fraction": cropped / (packed + cropped),
        "cpu_cores": cpu / wall,
        "cpu_us_per_read_token": 1e6 * cpu_per_read_token,
        "cores_for_target": TARGET_TOKENS_PER_S / (1 - FINEWEB_CROPPED_FRACTION) * cpu_per_read_token,
        "first_batch_s": first_batch_s,
        "state_bytes": len(json.dumps(state, indent=4)),  # as grain's checkpoint handler writes it
        "buffered_row_groups": len(state["buffer"].split()),
        "restore_s": restore_s,
        "epoch": state["epoch"],
    }


def print_table(results: list[dict]) -> None:
    columns = [("workers", "{:d}"), ("tokens_per_s", "{:,.0f}"), ("read_per_s", "{:,.0f}"),
               ("cropped_fraction", "{:.1%}"), ("cpu_cores", "{:.2f}"), ("cpu_us_per_read_token", "{:.2f}"),
               ("cores_for_target", "{:.1f}"),
               ("first_batch_s", "{:.2f}"), ("state_bytes", "{:,d}"), ("buffered_row_groups", "{:d}"),
               ("restore_s", "{:.2f}"), ("epoch", "{:d}")]
    cells = [[fmt.format(result[name]) for name, fmt in columns] for result in results]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _) in enumerate(columns)]
    print("  ".join(name.rjust(w) for (name, _), w in zip(columns, widths)))
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--builtin", action="store_true", help="bench on the built-in corpus with a tokenizer "
                        "trained on it (--vocab-size), all in a temporary directory")
    parser.add_argument("--vocab-size", type=int, default=8192, help="with --builtin (default 8192)")
    parser.add_argument("--data-dir", default=None, help="shards (default: <base_dir>/base_data)")
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer (default: <base_dir>/tokenizer)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32, help="rows per micro-step on this process")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokeniser threads to try")
    parser.add_argument("--buffer-docs", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.builtin:
            documents = dataset.builtin_documents()
            paths = dataset.write_shards(lambda: documents, tmp, chars_per_shard=250_000, docs_per_row_group=16,
                                         source="builtin")
            train_texts = (text for path, row_group in dataset.list_row_groups("train", tmp)
                           for text in dataset.read_row_group(path, row_group))
            start = time.perf_counter()
            tokenizer = Tokenizer.train_from_iterator(train_texts, args.vocab_size)
            print(f"built-in corpus: {len(documents)} documents in {len(paths)} shards; tokenizer of "
                  f"{tokenizer.get_vocab_size()} tokens trained in {time.perf_counter() - start:.1f}s")
            data_dir = tmp
        else:
            tokenizer, data_dir = get_tokenizer(args.tokenizer_dir), args.data_dir
        print(f"T={args.seq_len}, batch {args.grad_accum} x {args.batch_size} rows, buffer {args.buffer_docs} docs, "
              f"{args.batches} batches per setting, 1 process")
        results = [bench_loader(tokenizer, data_dir, seq_len=args.seq_len, batch_size=args.batch_size,
                                grad_accum=args.grad_accum, workers=workers, buffer_docs=args.buffer_docs,
                                batches=args.batches) for workers in args.workers]
    print_table(results)
    print(f"tokens_per_s: delivered in batches; read_per_s: read and tokenised. cores_for_target: CPU cores to "
          f"deliver {TARGET_TOKENS_PER_S:,.0f} tokens/s (d20 on 8 H100s, per host) at the measured CPU cost per token "
          f"read, with {FINEWEB_CROPPED_FRACTION:.0%} of tokens read cropped away (FineWeb at T=2048)")


if __name__ == "__main__":
    main()
