"""The pretraining corpus: parquet shards with one string column `text`, read row group by row group.
The last shard is the validation split; all others are training.

  python -m jaxchat.dataset -n 8                 download the first 8 FineWeb-Edu shards (~100 MB each)
  python -m jaxchat.dataset --from-text PATH...  shards from your own .txt / .md / .jsonl files or folders
  python -m jaxchat.dataset --builtin            shards from prose that ships with Python (no download)

Shards go to <base_dir>/base_data (or --data-dir).
"""

import argparse
import ast
import http.client
import json
import math
import os
import random
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq

from jaxchat.common import Progress, eta_text, get_base_dir

# FineWeb-Edu, re-shuffled by Karpathy into 1,823 shards of ~250M characters each.
BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
BASE_URL_ENV = "JAXCHAT_DATA_URL"  # a mirror, or a local server in the tests
MAX_SHARD = 1822
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
# Download


class DownloadError(RuntimeError):
    pass


def _fetch(url: str, out, timeout_s: float, on_bytes: Callable[[int], None]) -> None:
    request = urllib.request.Request(url, headers={"User-Agent": "jaxchat"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        expected = response.headers.get("Content-Length")
        received = 0
        while chunk := response.read(1 << 20):
            out.write(chunk)
            received += len(chunk)
            on_bytes(len(chunk))
    if expected is not None and received != int(expected):
        raise OSError(f"connection closed after {received:,} of {int(expected):,} bytes")


def _is_permanent(error: Exception) -> bool:
    """A missing file stays missing; retrying only makes sense for server trouble and network errors."""
    return isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 and error.code not in (408, 429)


def download_shard(index: int, data_dir: str, base_url: str, *, max_attempts: int = 5, backoff_s: float = 2.0,
                   timeout_s: float = 60.0, on_bytes: Callable[[int], None] = lambda n: None,
                   log: Callable[[str], None] = print) -> bool:
    """Fetch one shard into data_dir, unless a readable copy is already there. Each attempt writes to a
    temporary file that is renamed only once it opens as a parquet shard, so a failure never leaves a
    partial shard behind. Waits backoff_s * 2^k between attempts. True when it downloaded, False when
    the shard was already complete; DownloadError when every attempt failed."""
    name = shard_filename(index)
    path = os.path.join(data_dir, name)
    if os.path.exists(path):
        try:
            open_shard(path)
            return False
        except CorruptShardError:
            log(f"{name}: the file on disk is not a readable shard; downloading it again")
            os.remove(path)
    url = f"{base_url.rstrip('/')}/{name}"
    for attempt in range(1, max_attempts + 1):
        fd, tmp_path = tempfile.mkstemp(dir=data_dir, prefix=name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                _fetch(url, f, timeout_s, on_bytes)
            open_shard(tmp_path)
            os.replace(tmp_path, path)
            return True
        except (OSError, CorruptShardError, http.client.HTTPException) as e:  # HTTPException: not an OSError
            error = e
        finally:
            if os.path.exists(tmp_path):
                os.remove(tmp_path)
        if attempt == max_attempts or _is_permanent(error):
            break
        wait_s = backoff_s * 2 ** (attempt - 1)
        log(f"{name}: attempt {attempt}/{max_attempts} failed ({error}); retrying in {wait_s:g}s")
        time.sleep(wait_s)
    raise DownloadError(f"could not download {url} after {attempt} attempt(s): {error}")


def download_shards(num_files: int, data_dir: str | None = None, base_url: str | None = None,
                    num_workers: int = 4, **download_kwargs) -> list[str]:
    """Download shards 0..num_files-1 (-1: all) on num_workers threads. Returns the names that failed."""
    data_dir = get_data_dir(data_dir)
    base_url = base_url or os.environ.get(BASE_URL_ENV) or BASE_URL
    os.makedirs(data_dir, exist_ok=True)
    if os.path.exists(os.path.join(data_dir, CORPUS_INFO_FILE)):
        raise ValueError(f"{data_dir} holds a corpus built from local text ({CORPUS_INFO_FILE}); downloading "
                         f"FineWeb-Edu into it would mix the two. Use another --data-dir or JAXCHAT_BASE_DIR.")
    count = MAX_SHARD + 1 if num_files == -1 else min(num_files, MAX_SHARD + 1)
    progress = Progress()
    progress.line(f"{count} shards from {base_url} into {data_dir} with {num_workers} workers")
    lock = threading.Lock()
    tally = {"bytes": 0, "finished": 0, "failed": []}
    start = time.monotonic()

    def show_status(force: bool = False) -> None:
        mb = tally["bytes"] / 1e6
        rate = mb / max(time.monotonic() - start, 1e-9)
        eta = eta_text(tally["finished"], count, time.monotonic() - start)
        progress.status(f"[{tally['finished']}/{count} files] {mb:,.1f} MB at {rate:,.1f} MB/s | {eta}", force)

    def on_bytes(n: int) -> None:
        with lock:
            tally["bytes"] += n
        show_status()

    def fetch_one(index: int) -> None:
        name = shard_filename(index)
        t0 = time.monotonic()
        try:
            downloaded = download_shard(index, data_dir, base_url, on_bytes=on_bytes, log=progress.line,
                                        **download_kwargs)
            size_mb = os.path.getsize(os.path.join(data_dir, name)) / 1e6
            what = f"{size_mb:,.1f} MB in {time.monotonic() - t0:.1f}s" if downloaded else "already complete"
            progress.line(f"{name}: {what}")
        except DownloadError as e:
            with lock:
                tally["failed"].append(name)
            progress.line(f"{name}: FAILED: {e}")
        with lock:
            tally["finished"] += 1
        show_status(force=True)

    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        list(pool.map(fetch_one, range(count)))
    failed = sorted(tally["failed"])
    progress.close(f"done: {count - len(failed)}/{count} shards in {data_dir}, {tally['bytes'] / 1e6:,.1f} MB "
                   f"downloaded in {time.monotonic() - start:.1f}s")
    return failed


# -----------------------------------------------------------------------------------------------
# Local corpora: your own text files, or prose that ships with Python

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"


def split_into_documents(text: str, max_chars: int) -> list[str]:
    """Cut a long text at paragraph breaks into documents of at most max_chars (a longer paragraph is cut
    hard), so one big file still gives many documents and shards."""
    if len(text) <= max_chars:
        return [text] if text.strip() else []
    pieces = [para[i:i + max_chars] for para in text.split("\n\n") for i in range(0, max(len(para), 1), max_chars)]
    documents, current, size = [], [], 0
    for piece in pieces:
        if current and size + 2 + len(piece) > max_chars:
            documents.append("\n\n".join(current))
            current, size = [], 0
        size += len(piece) + (2 if current else 0)
        current.append(piece)
    documents.append("\n\n".join(current))
    return [doc for doc in documents if doc.strip()]


def find_text_files(paths: Iterable[str]) -> list[str]:
    """The .txt/.md/.jsonl files named, or found (recursively, sorted) in the folders named."""
    files = []
    suffixes = TEXT_SUFFIXES + (JSONL_SUFFIX,)
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs.sort()
                files += [os.path.join(root, name) for name in sorted(names) if name.endswith(suffixes)]
        elif os.path.isfile(path):
            if not path.endswith(suffixes):
                raise ValueError(f"{path}: unsupported file type; use {', '.join(suffixes)} files or folders")
            files.append(path)
        else:
            raise FileNotFoundError(f"{path}: no such file or folder")
    if not files:
        raise FileNotFoundError(f"no {', '.join(suffixes)} files in {', '.join(paths)}")
    return files


def text_file_documents(files: Iterable[str], max_doc_chars: int) -> Iterator[str]:
    """A .txt/.md file gives documents cut at paragraph breaks; a .jsonl line {"text": ...} is one document."""
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                if not path.endswith(JSONL_SUFFIX):
                    yield from split_into_documents(f.read(), max_doc_chars)
                    continue
                for line_number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{path}:{line_number}: expected a JSON object with a string \"text\"")
                    if record["text"].strip():
                        yield record["text"]
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e})") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON line ({e})") from e


def _python_file_prose(path: str) -> str:
    """The docstrings of one module in source order, or for pydoc_data/topics.py the language reference
    text it holds. Parsed with ast: nothing is imported or executed."""
    try:
        with open(path, encoding="utf-8") as f, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. SyntaxWarning for odd escapes in old modules
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    if path.endswith(os.path.join("pydoc_data", "topics.py")):
        texts = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and len(node.value) > 200]
    else:
        nodes = [node for node in ast.walk(tree)
                 if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        nodes.sort(key=lambda node: getattr(node, "lineno", 0))
        texts = [doc for node in nodes if (doc := ast.get_docstring(node))]
    return "\n\n".join(texts)


def builtin_documents(max_doc_chars: int = 10_000, seed: int = 0) -> list[str]:
    """Real English prose without a download: the docstrings of the Python standard library on this machine
    and the language reference text behind pydoc (about 2 MB on CPython 3.11), cut into documents and
    shuffled with a fixed seed so that the validation shard looks like the training shards."""
    stdlib = sysconfig.get_paths()["stdlib"]
    skip_dirs = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    documents = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs)
        for name in sorted(names):
            if name.endswith(".py"):
                documents += split_into_documents(_python_file_prose(os.path.join(root, name)), max_doc_chars)
    random.Random(seed).shuffle(documents)
    return documents


def write_shards(make_documents: Callable[[], Iterable[str]], data_dir: str | None = None, *,
                 chars_per_shard: int, docs_per_row_group: int, overwrite: bool = False,
                 source: str = "local text") -> list[str]:
    """Write documents as shards of at most chars_per_shard characters (at least two: the last is the
    validation split), docs_per_row_group documents per row group. make_documents is called twice (count,
    then write), so a corpus larger than memory streams through. Returns the shard paths."""
    data_dir = get_data_dir(data_dir)
    os.makedirs(data_dir, exist_ok=True)
    existing = list_parquet_files(data_dir)
    if existing and not overwrite:
        raise ValueError(f"{data_dir} already holds {len(existing)} shards; pass --overwrite to replace them "
                         f"or choose another --data-dir / JAXCHAT_BASE_DIR")
    lengths = [len(doc) for doc in make_documents() if doc.strip()]
    if len(lengths) < 2:
        raise ValueError(f"need at least 2 non-empty documents for a training and a validation shard, "
                         f"got {len(lengths)}")
    for path in existing:
        os.remove(path)
    total_chars = sum(lengths)
    num_shards = max(2, math.ceil(total_chars / chars_per_shard))

    paths = []

    def flush(docs: list[str]) -> None:
        path = os.path.join(data_dir, shard_filename(len(paths)))
        table = pa.table({"text": pa.array(docs, type=pa.string())})
        pq.write_table(table, path + ".tmp", row_group_size=docs_per_row_group, compression="zstd")
        os.replace(path + ".tmp", path)
        paths.append(path)

    # A document goes to the shard its middle character falls in, so shards hold equal shares of the text;
    # the first document lands in shard 0 and the last in a later one, so there are always >= 2 shards.
    current, current_index, chars_before = [], 0, 0
    for doc in make_documents():
        if not doc.strip():
            continue
        index = min(num_shards - 1, int((chars_before + len(doc) / 2) * num_shards / total_chars))
        if index != current_index and current:
            flush(current)
            current = []
        current_index = index
        current.append(doc)
        chars_before += len(doc)
    flush(current)

    info = {"source": source, "documents": len(lengths), "characters": total_chars, "shards": len(paths),
            "chars_per_shard": chars_per_shard, "docs_per_row_group": docs_per_row_group}
    with open(os.path.join(data_dir, CORPUS_INFO_FILE), "w") as f:
        json.dump(info, f, indent=2)
    return paths


# -----------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("-n", "--num-files", type=int, help=f"download shards 0..N-1 of FineWeb-Edu "
                        f"(-1: all {MAX_SHARD + 1}); the last one downloaded is the validation split")
    source.add_argument("--from-text", nargs="+", metavar="PATH", help="build shards from .txt/.md/.jsonl "
                        "files or folders (a .jsonl line is {\"text\": ...}; the last shard is validation)")
    source.add_argument("--builtin", action="store_true", help="build shards from the Python standard "
                        "library's documentation (~2 MB of English prose, no download)")
    parser.add_argument("-w", "--num-workers", type=int, default=4, help="parallel downloads (default 4)")
    parser.add_argument("--base-url", default=None, help=f"download from here (default: ${BASE_URL_ENV} or "
                        f"{BASE_URL})")
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
            failed = download_shards(args.num_files, args.data_dir, args.base_url, args.num_workers)
            if failed:
                sys.exit(f"error: {len(failed)} shard(s) failed: {', '.join(failed)}. Run the same command "
                         f"again: complete shards are skipped.")
            return
        if args.builtin:
            documents = builtin_documents(args.max_doc_chars)
            make_documents, source_name = (lambda: documents), "builtin: Python standard library documentation"
            chars_per_shard, docs_per_row_group = 250_000, 16
        else:
            files = find_text_files(args.from_text)
            make_documents = lambda: text_file_documents(files, args.max_doc_chars)  # noqa: E731
            source_name = f"text: {', '.join(args.from_text)}"
            chars_per_shard, docs_per_row_group = 50_000_000, 1024
        paths = write_shards(make_documents, args.data_dir, overwrite=args.overwrite, source=source_name,
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
