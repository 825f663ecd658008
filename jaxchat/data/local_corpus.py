"""Shards built from local text, no download: your own .txt / .md / .jsonl files, or the prose that ships
with Python (the standard library's docstrings). The last shard is the validation split, as for FineWeb.

  python -m jaxchat.dataset --from-text PATH...  shards from your own files or folders
  python -m jaxchat.dataset --builtin            shards from Python's documentation (~2 MB)
"""

import ast
import json
import math
import os
import random
import sysconfig
import warnings
from collections.abc import Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from jaxchat import storage
from jaxchat.data.shards import CORPUS_INFO_FILE, get_data_dir, list_parquet_files, shard_filename


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


def _statements(node: ast.AST) -> Iterator[ast.AST]:
    """node and every statement under it, not the expressions: a docstring's owner (a module, class or
    function) is a statement, so only statement lists are searched (ast.walk visits every node: 1.2M over the
    standard library, most of the corpus's time)."""
    yield node
    for field in ("body", "orelse", "finalbody", "handlers", "cases"):
        for child in getattr(node, field, ()):
            if isinstance(child, ast.AST):
                yield from _statements(child)


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
        nodes = [node for node in _statements(tree)
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
    storage.makedirs(data_dir)
    existing = list_parquet_files(data_dir)
    if existing and not overwrite:
        raise ValueError(f"{data_dir} already holds {len(existing)} shards; pass --overwrite to replace them "
                         f"or choose another --data-dir / JAXCHAT_BASE_DIR")
    lengths = [len(doc) for doc in make_documents() if doc.strip()]
    if len(lengths) < 2:
        raise ValueError(f"need at least 2 non-empty documents for a training and a validation shard, "
                         f"got {len(lengths)}")
    for path in existing:
        storage.remove(path)
    total_chars = sum(lengths)
    num_shards = max(2, math.ceil(total_chars / chars_per_shard))

    paths = []

    def flush(docs: list[str]) -> None:
        path = storage.join(data_dir, shard_filename(len(paths)))
        table = pa.table({"text": pa.array(docs, type=pa.string())})
        with storage.staged_file(path) as staged:  # on the local disk: pyarrow writes it, then a bucket gets it whole
            pq.write_table(table, staged, row_group_size=docs_per_row_group, compression="zstd")
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
    storage.write_text(storage.join(data_dir, CORPUS_INFO_FILE), json.dumps(info, indent=2))
    return paths


