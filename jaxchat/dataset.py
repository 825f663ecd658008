"""Get the pretraining corpus: the command line over jaxchat/data/download.py (FineWeb-Edu, ClimbMix) and
jaxchat/data/local_corpus.py (your own text, or Python's documentation); shards are read by jaxchat/data/shards.py.

  python -m jaxchat.dataset -n 8                 download the first 8 FineWeb-Edu shards (~100 MB each)
  python -m jaxchat.dataset -n 8 --corpus climbmix   8 ClimbMix training shards + its validation shard
  python -m jaxchat.dataset --from-text PATH...  shards from your own .txt / .md / .jsonl files or folders
  python -m jaxchat.dataset --builtin            shards from prose that ships with Python (no download)

Shards go to <base_dir>/base_data (ClimbMix: <base_dir>/base_data_climbmix) or --data-dir. Nothing in
jaxchat imports this module: it is the command's (so that download and local_corpus, which build on jaxchat.data.shards, import no circle).
"""

import argparse
import json
import sys

from jaxchat import storage
from jaxchat.data import download, local_corpus
from jaxchat.data.shards import CORPORA, CORPUS_INFO_FILE, DEFAULT_CORPUS, count_row_groups
# scripts.bench reads shards through this module's names; it may import them from jaxchat.data.shards instead
from jaxchat.data.shards import list_row_groups, read_row_group  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-n", "--num-files", type=int, help="download N shards of --corpus (-1: all): FineWeb-Edu's "
                        "0..N-1, the last one downloaded the validation split; ClimbMix's 0..N-1 and its validation "
                        "shard, always")
    source.add_argument("--from-text", nargs="+", metavar="PATH", help="build shards from .txt/.md/.jsonl "
                        "files or folders (a .jsonl line is {\"text\": ...}; the last shard is validation)")
    source.add_argument("--builtin", action="store_true", help="build shards from the Python standard "
                        "library's documentation (~2 MB of English prose, no download)")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (default 4)")
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, choices=tuple(CORPORA), help="the corpus -n downloads: "
                        "fineweb-edu (recipe bdcc030's) or climbmix (recipe 92d63d4's) (default: %(default)s)")
    parser.add_argument("--base-url", default=None, help=f"download from here (default: ${download.BASE_URL_ENV} or "
                        "the corpus's Hugging Face URL)")
    parser.add_argument("--data-dir", default=None, help="where shards go (default: <base_dir>/base_data, "
                        "<base_dir>/base_data_climbmix for ClimbMix)")
    parser.add_argument("--chars-per-shard", type=int, default=None,
                        help="local corpora: characters per shard (default: 250k builtin, 50M from text)")
    parser.add_argument("--docs-per-row-group", type=int, default=None,
                        help="local corpora: documents per row group (default: 16 builtin, 1024 from text)")
    parser.add_argument("--max-doc-chars", type=int, default=10_000,
                        help="local corpora: text files are cut at paragraph breaks into documents this long")
    parser.add_argument("--overwrite", action="store_true", help="local corpora: replace shards already there")
    args = parser.parse_args(argv)
    if args.num_files is not None and not (args.num_files == -1 or args.num_files >= 1):
        parser.error("-n must be -1 (all shards) or at least 1")
    if args.num_workers < 1:
        parser.error("-w must be at least 1")

    try:
        if args.num_files is not None:
            failed = download.download_shards(args.num_files, args.data_dir, args.base_url, args.num_workers,
                                              corpus=args.corpus)
            if failed:
                sys.exit(f"error: {len(failed)} shard(s) failed: {', '.join(failed)}. Run the same command "
                         f"again: complete shards are skipped.")
            return
        if args.builtin:
            documents = local_corpus.builtin_documents(args.max_doc_chars)
            make_documents, source_name = (lambda: documents), "builtin: Python standard library documentation"
            chars_per_shard, docs_per_row_group = 250_000, 16
        else:
            files = local_corpus.find_text_files(args.from_text)
            make_documents = lambda: local_corpus.text_file_documents(files, args.max_doc_chars)  # noqa: E731
            source_name = f"text: {', '.join(args.from_text)}"
            chars_per_shard, docs_per_row_group = 50_000_000, 1024
        paths = local_corpus.write_shards(make_documents, args.data_dir, overwrite=args.overwrite, source=source_name,
                             chars_per_shard=args.chars_per_shard or chars_per_shard,
                             docs_per_row_group=args.docs_per_row_group or docs_per_row_group)
    except (ValueError, OSError, download.OfflineError, storage.StorageError) as e:
        sys.exit(f"error: {e}")
    info = json.loads(storage.read_text(storage.join(storage.dirname(paths[0]), CORPUS_INFO_FILE)))
    row_groups = sum(map(count_row_groups, paths))
    print(f"{info['documents']:,} documents, {info['characters']:,} characters -> {len(paths)} shards "
          f"({len(paths) - 1} train + 1 val), {row_groups} row groups, in {storage.dirname(paths[0])}")


if __name__ == "__main__":
    main()
