"""The pretraining corpus: parquet shards with one string column `text`, read row group by row group.
The last shard is the validation split; all others are training. Getting shards: jaxchat/download.py
(FineWeb-Edu) and jaxchat/local_corpus.py (your own text, or Python's documentation), from this command:

  python -m jaxchat.dataset -n 8                 download the first 8 FineWeb-Edu shards (~100 MB each)
  python -m jaxchat.dataset --from-text PATH...  shards from your own .txt / .md / .jsonl files or folders
  python -m jaxchat.dataset --builtin            shards from prose that ships with Python (no download)

Shards go to <base_dir>/base_data (or --data-dir).
"""

import argparse
import json
import os
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from jaxchat.common import get_base_dir

CORPUS_INFO_FILE = "corpus.json"  # marks a data dir built from local text, so downloads never mix in
GET_DATA_HINT = "run `python -m jaxchat.dataset -n 8` (FineWeb-Edu) or `python -m jaxchat.dataset --builtin` (offline)"


def shard_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def get_data_dir(data_dir: str | None = None) -> str:
    return data_dir or os.path.join(get_base_dir(), "base_data")


class CorruptShardError(ValueError):
    """A file that is not a readable parquet shard with a `text` column."""


# -----------------------------------------------------------------------------------------------
# Listing and reading


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Full paths of the shards in data_dir, sorted by name (so the last one is the validation split)."""
    data_dir = get_data_dir(data_dir)
    if not os.path.isdir(data_dir):
        return []
    return [os.path.join(data_dir, name) for name in sorted(os.listdir(data_dir)) if name.endswith(".parquet")]


def parquet_paths_for_split(split: str, data_dir: str | None = None) -> list[str]:
    """train: every shard but the last; val: the last one."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    paths = list_parquet_files(data_dir)
    if len(paths) < 2:
        found = "no shards" if not paths else "only one shard (the validation split)"
        raise FileNotFoundError(f"{found} in {get_data_dir(data_dir)}; need at least 2: {GET_DATA_HINT}")
    return paths[:-1] if split == "train" else paths[-1:]


def open_shard(path: str) -> pq.ParquetFile:
    """Open a shard and check that it is parquet with a string `text` column; the error names the file."""
    try:
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise CorruptShardError(f"{path} is not a readable parquet file ({e}); delete it and fetch or build "
                                f"it again") from e
    field = parquet_file.schema_arrow.field("text") if "text" in parquet_file.schema_arrow.names else None
    if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise CorruptShardError(f"{path} has no string column 'text' (columns: {parquet_file.schema_arrow.names})")
    return parquet_file


def list_row_groups(split: str, data_dir: str | None = None) -> list[tuple[str, int]]:
    """Every (shard path, row group index) of the split, in reading order."""
    return [(path, rg) for path in parquet_paths_for_split(split, data_dir)
            for rg in range(open_shard(path).num_row_groups)]


def read_row_group(path: str, row_group: int) -> list[str]:
    """The documents of one row group."""
    parquet_file = open_shard(path)
    try:
        table = parquet_file.read_row_group(row_group, columns=["text"])
    except (pa.ArrowException, OSError) as e:
        raise CorruptShardError(f"{path}: row group {row_group} is unreadable ({e}); delete the file and "
                                f"fetch or build it again") from e
    return table.column("text").to_pylist()


# -----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    from jaxchat import download, local_corpus  # here, not at the top: both import this module

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-n", "--num-files", type=int, help=f"download shards 0..N-1 of FineWeb-Edu "
                        f"(-1: all {download.MAX_SHARD + 1}); the last one downloaded is the validation split")
    source.add_argument("--from-text", nargs="+", metavar="PATH", help="build shards from .txt/.md/.jsonl "
                        "files or folders (a .jsonl line is {\"text\": ...}; the last shard is validation)")
    source.add_argument("--builtin", action="store_true", help="build shards from the Python standard "
                        "library's documentation (~2 MB of English prose, no download)")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (default 4)")
    parser.add_argument("--base-url", default=None, help=f"download from here (default: ${download.BASE_URL_ENV} or "
                        f"{download.BASE_URL})")
    parser.add_argument("--data-dir", default=None, help="where shards go (default: <base_dir>/base_data)")
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
            failed = download.download_shards(args.num_files, args.data_dir, args.base_url, args.num_workers)
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
    except (ValueError, OSError) as e:
        sys.exit(f"error: {e}")
    with open(os.path.join(os.path.dirname(paths[0]), CORPUS_INFO_FILE)) as f:
        info = json.load(f)
    row_groups = sum(open_shard(path).num_row_groups for path in paths)
    print(f"{info['documents']:,} documents, {info['characters']:,} characters -> {len(paths)} shards "
          f"({len(paths) - 1} train + 1 val), {row_groups} row groups, in {os.path.dirname(paths[0])}")


if __name__ == "__main__":
    main()
