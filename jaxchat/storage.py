"""Paths of the base dir on a local disk or in a Google Cloud Storage bucket (`gs://bucket/prefix`): the one seam
through which every module touches a file of the base dir (run directories, the tokenizer, data shards, reports),
so that hosts that share no filesystem can share a bucket, as MaxText's `base_output_directory` and levanter's
`checkpointer.base_path` do.

A local path goes to os and shutil exactly as before; a `gs://` URL to gcsfs (the fsspec filesystem that Orbax's
etils.epath also uses for gs://; `pip install -e '.[gcs]'`). What differs in a bucket, and how jaxchat deals with it:
- there are no directories, only object names with slashes: makedirs makes nothing, and a "directory" exists once
  an object lies under it;
- a rename is a copy and a delete of every object under the name (move): jaxchat moves steps only when a person
  asked for it (--overwrite) or a step is damaged, never per step;
- listings are read fresh each time (no cache: another host may have written since), and jaxchat lists a run
  directory at a start, at a restore and once per save, never per step;
- Orbax marks a complete step with `commit_success.txt`, written last, instead of renaming a temporary directory
  (jaxchat.checkpoint.run_directory reads it through Orbax's own test).
Other schemes (s3://, ...) are refused in one line (check_supported): Orbax 0.12.8 turns `s3://b` into a local
folder `s3:/b`.
"""

import contextlib
import functools
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import IO

GCS_PREFIX = "gs://"


class StorageError(RuntimeError):
    """A base dir that cannot be used (an unsupported scheme, the gcs extra missing, no credentials): one line."""


def is_url(path: str) -> bool:
    return "://" in str(path)


def check_supported(path: str) -> str:
    """path, if jaxchat can write there; else StorageError in one line."""
    path = str(path)
    if is_url(path) and not path.startswith(GCS_PREFIX):
        scheme = path.split("://", 1)[0]
        raise StorageError(f"{path}: {scheme}:// is not supported, only local paths and gs:// (Orbax 0.12.8 turns "
                           f"'{scheme}://bucket' into a local folder '{scheme}:/bucket'); mount the bucket, or use a "
                           "local or gs:// base dir")
    if path.startswith(GCS_PREFIX) and not path[len(GCS_PREFIX):].split("/", 1)[0]:
        raise StorageError(f"{path} names no bucket: use gs://BUCKET or gs://BUCKET/PREFIX")
    return path


@functools.cache
def _gcs():
    """The process's gcsfs filesystem, without a listings cache (another host may write between two listings)."""
    try:
        import gcsfs
    except ImportError:
        raise StorageError("gs:// paths need gcsfs: pip install -e '.[gcs]'") from None
    # Google's default credentials, or an error: gcsfs's own default falls back to anonymous access without a
    # word, which a private bucket answers with 401s later. An emulator (the tests') takes none.
    token = None if os.environ.get("STORAGE_EMULATOR_HOST") else "google_default"
    try:
        return gcsfs.GCSFileSystem(token=token, use_listings_cache=False, skip_instance_cache=True)
    except Exception as e:
        raise (_credentials_error(e) or e) from None


def _credentials_error(error: BaseException) -> StorageError | None:
    """One line for a client that found no Google credentials, or None if error is something else."""
    text = f"{type(error).__name__}: {error}"
    if "DefaultCredentialsError" in text or "credentials were not found" in text.lower():
        return StorageError("no Google Cloud credentials for gs://: run `gcloud auth application-default login`, set "
                            "GOOGLE_APPLICATION_CREDENTIALS to a service account's key, or run on a VM whose service "
                            "account may use the bucket")
    return None


def _on_gcs(method: str, *args, **kwargs):
    try:
        return getattr(_gcs(), method)(*args, **kwargs)
    except Exception as e:
        if (line := _credentials_error(e)) is not None:
            raise line from None
        raise


def join(path: str, *parts: str) -> str:
    return posixpath.join(str(path), *parts) if is_url(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(str(path).rstrip("/")) if is_url(path) else os.path.dirname(path)


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is (os.path.abspath('gs://b') is a local 'gs:/b')."""
    return str(path) if is_url(path) else os.path.abspath(path)


def expand(path: str) -> str:
    """~ expanded in a local path, and the path checked (check_supported)."""
    return check_supported(path) if is_url(path) else os.path.expanduser(path)


def exists(path: str) -> bool:
    return _on_gcs("exists", path) if is_url(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _on_gcs("isdir", path) if is_url(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    return _on_gcs("isfile", path) if is_url(path) else os.path.isfile(path)


def listdir(path: str) -> list[str]:
    """The names in a directory (in a bucket: under the prefix path/); FileNotFoundError if there is none."""
    if not is_url(path):
        return os.listdir(path)
    names = [posixpath.basename(p.rstrip("/")) for p in _on_gcs("ls", path, detail=False)]
    return [n for n in names if n]


def makedirs(path: str) -> None:
    """A local directory and its parents; nothing in a bucket (an object's name makes its 'directories')."""
    if not is_url(path):
        os.makedirs(path, exist_ok=True)


def open_file(path: str, mode: str = "r", encoding: str | None = None) -> IO:
    if not is_url(path):
        return open(path, mode, encoding=encoding)
    # readahead: each read fetches what it asks for and the rest of a 5 MB block (a parquet footer, then a row
    # group's column). gcsfs 2026's default ("adaptive") prefetches on background threads whose deferred close
    # fails with tracebacks at interpreter exit
    options = {"cache_type": "readahead"} if "r" in mode else {}
    if "b" not in mode:
        options["encoding"] = encoding
    return _on_gcs("open", path, mode, **options)


def read_text(path: str) -> str:
    with open_file(path, "r", encoding="utf-8") as f:
        return f.read()


def read_bytes(path: str) -> bytes:
    with open_file(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes a whole file: locally to a staging name renamed over path (a reader never sees half of it); in a
    bucket one upload, which GCS makes visible whole or not at all."""
    if is_url(path):
        _on_gcs("pipe_file", path, data)
        return
    with staged_file(path) as staged, open(staged, "wb") as f:
        f.write(data)


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def append_text(path: str, text: str) -> None:
    """Adds text at the end of a file (made if missing). A bucket's objects cannot grow: the object is read and
    written again whole (for small files written now and then, as a run's curve at its evaluations)."""
    if is_url(path):
        old = read_bytes(path) if exists(path) else b""
        write_bytes(path, old + text.encode("utf-8"))
        return
    with open(path, "a", encoding="utf-8", newline="") as f:
        f.write(text)


@contextlib.contextmanager
def staged_file(path: str) -> Iterator[str]:
    """A new local file name to write what becomes path: when the block ends without an error, the file is renamed
    over path on a disk (beside it, so the rename is atomic) or uploaded in one piece to a bucket (from the local
    temporary folder: an object is visible whole or not at all); either way nothing is left behind. Unique, so
    writers on threads never share one; the file is made by the caller's open(), with the usual mode."""
    name = f"{posixpath.basename(str(path))}.{uuid.uuid4().hex[:12]}.tmp"
    staged = os.path.join(tempfile.gettempdir() if is_url(path) else os.path.dirname(path), name)
    try:
        yield staged
        if is_url(path):
            _on_gcs("put_file", staged, path)
        else:
            os.replace(staged, path)
    finally:
        if os.path.exists(staged):  # uploaded, or a write that failed (disk full, a check refused it)
            os.remove(staged)


def move(source: str, target: str) -> None:
    """A rename on a disk; in a bucket a copy then a delete of each object under source (not atomic: used for steps
    set aside, which a later start checks again before it trusts them)."""
    if is_url(source):
        _on_gcs("mv", source, target, recursive=True)
    else:
        os.rename(source, target)


def remove(path: str) -> None:
    if is_url(path):
        _on_gcs("rm_file", path)
    else:
        os.remove(path)


def rmtree(path: str) -> None:
    if is_url(path):
        _on_gcs("rm", path, recursive=True)
    else:
        shutil.rmtree(path)


def size(path: str) -> int:
    """A file's size in bytes."""
    return _on_gcs("size", path) if is_url(path) else os.path.getsize(path)


def getmtime(path: str) -> float:
    """When a file was last written (seconds since the epoch); of a bucket 'directory', its newest object's."""
    if not is_url(path):
        return os.path.getmtime(path)
    if _on_gcs("isfile", path):
        return _on_gcs("modified", path).timestamp()
    return max(_on_gcs("modified", p).timestamp() for p in _on_gcs("find", path))
