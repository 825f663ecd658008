"""HTTP downloads: one fetcher (retries with back-off, a temporary file renamed only once complete, a
progress line), and a corpus's shards (jaxchat.data.shards.CORPORA: FineWeb-Edu, ClimbMix) fetched with it.

  python -m jaxchat.dataset -n 8                     the first 8 FineWeb-Edu shards (~100 MB each), 4 at a time
  python -m jaxchat.dataset -n 8 --corpus climbmix   8 ClimbMix training shards and its validation shard
"""

import errno
import http.client
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from jaxchat import storage
from jaxchat.common import Progress, eta_text
from jaxchat.data.shards import (CORPUS_INFO_FILE, DEFAULT_CORPUS, CorruptShardError, count_row_groups, get_corpus,
                                 get_data_dir, shard_filename)

BASE_URL_ENV = "JAXCHAT_DATA_URL"  # a mirror, or a local server in the tests


class DownloadError(RuntimeError):
    pass


class OfflineError(DownloadError):
    """The host's name did not resolve, or no route leads to it: this machine is offline (or the address is
    wrong). Not retried: minutes of back-off would not bring a network back. reason: that, in words."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _offline_reason(error: Exception) -> str | None:
    """Why error says the network cannot be reached ('cannot resolve HOST', 'network unreachable'), or None.
    urllib wraps the resolver's socket.gaierror, or connect()'s ENETUNREACH/EHOSTUNREACH, in a URLError."""
    reason = error.reason if isinstance(error, urllib.error.URLError) else error
    if isinstance(reason, socket.gaierror):
        return f"cannot resolve the host name ({reason.strerror or reason})"
    if isinstance(reason, OSError) and reason.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
        return f"no route to the host ({reason.strerror})"
    return None


def _is_permanent(error: Exception) -> bool:
    """A missing file stays missing, and nothing listens where the connection was refused (a wrong mirror,
    or no network); retrying only makes sense for server trouble and network errors."""
    if isinstance(error, urllib.error.URLError) and isinstance(error.reason, ConnectionRefusedError):
        return True
    return isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 and error.code not in (408, 429)


def _get(url: str, out, timeout_s: float, on_bytes: Callable[[int, int | None], None]) -> None:
    """One attempt: the body of url into out; on_bytes(chunk size, Content-Length or None) per chunk."""
    request = urllib.request.Request(url, headers={"User-Agent": "jaxchat"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        length = response.headers.get("Content-Length")
        expected = int(length) if length is not None else None
        received = 0
        while chunk := response.read(1 << 20):
            out.write(chunk)
            received += len(chunk)
            on_bytes(len(chunk), expected)
    if expected is not None and received != expected:
        raise OSError(f"connection closed after {received:,} of {expected:,} bytes")


def fetch(url: str, path: str, *, check: Callable[[str], object] = lambda path: None, max_attempts: int = 5,
          backoff_s: float = 2.0, timeout_s: float = 60.0, on_bytes: Callable[[int], None] | None = None,
          log: Callable[[str], None] | None = None, label: str | None = None) -> None:
    """Download url to path. Each attempt writes a temporary file next to path, which check(tmp path) may
    reject (raising ValueError or OSError) and which is renamed to path only once it passed, so a failure
    never leaves a partial file behind. Server errors, network errors and rejected files are retried after
    backoff_s * 2^k seconds; a 4xx (but 408/429) or a refused connection is not. DownloadError (from the
    last attempt's error) when every attempt failed; OfflineError at once when the host cannot be reached at
    all (its name does not resolve, no route to it).
    Progress: on_bytes(chunk size) for a caller that shows many files at once; without it, a status line
    for this file. Retries are announced through log (default: that status line's Progress)."""
    label = label or os.path.basename(path)
    progress = Progress() if on_bytes is None else None
    log = log or (progress.line if progress else print)
    start, done = time.monotonic(), 0

    def count(n: int, total: int | None) -> None:
        nonlocal done
        done += n
        if on_bytes is not None:
            on_bytes(n)
            return
        elapsed = time.monotonic() - start
        of_total = f" of {total / 1e6:,.0f}" if total else ""
        progress.status(f"{label}: {done / 1e6:,.1f}{of_total} MB at {done / 1e6 / max(elapsed, 1e-9):,.1f} MB/s"
                        + (f" | {eta_text(done, total, elapsed)}" if total else ""))

    for attempt in range(1, max_attempts + 1):
        done = 0  # this attempt's bytes: a retry starts the file again
        try:
            with storage.staged_file(path) as tmp_path:  # checked on the local disk before a bucket gets it
                with open(tmp_path, "wb") as f:
                    _get(url, f, timeout_s, count)
                check(tmp_path)
            if progress:
                progress.close(f"{label}: {done / 1e6:,.1f} MB downloaded in {time.monotonic() - start:.1f}s")
            return
        except (OSError, ValueError, http.client.HTTPException) as e:  # HTTPException: not an OSError
            error = e
        if (offline := _offline_reason(error)) is not None:
            if progress:
                progress.close(f"{label}: failed")
            offline += "; the network is unreachable from this machine, or the address is wrong"
            raise OfflineError(f"could not download {url}: {offline}", offline) from error
        if attempt == max_attempts or _is_permanent(error):
            break
        wait_s = backoff_s * 2 ** (attempt - 1)
        log(f"{label}: attempt {attempt}/{max_attempts} failed ({error}); retrying in {wait_s:g}s")
        time.sleep(wait_s)
    if progress:
        progress.close(f"{label}: failed")
    raise DownloadError(f"could not download {url} after {attempt} attempt(s): {error}") from error


# -----------------------------------------------------------------------------------------------
# A corpus's shards


def download_shard(index: int, data_dir: str, base_url: str, log: Callable[[str], None] = print,
                   **fetch_kwargs) -> bool:
    """Fetch one shard into data_dir (with fetch's retries; it must open as a shard), unless a readable
    copy is already there. True when it downloaded, False when the shard was already complete."""
    name = shard_filename(index)
    path = storage.join(data_dir, name)
    if storage.exists(path):
        try:
            count_row_groups(path)
            return False
        except CorruptShardError:
            log(f"{name}: the file on disk is not a readable shard; downloading it again")
            storage.remove(path)
    fetch(f"{base_url.rstrip('/')}/{name}", path, check=count_row_groups, log=log, **fetch_kwargs)
    return True


def shards_to_fetch(num_files: int, corpus: str = DEFAULT_CORPUS) -> list[int]:
    """The shard indices of `-n num_files` (-1: all): shards 0..N-1, and for a corpus whose validation shard
    is always fetched (ClimbMix), N training shards and the last shard."""
    spec = get_corpus(corpus)
    if spec.val_always:
        train = spec.max_shard if num_files == -1 else min(num_files, spec.max_shard)
        return [*range(train), spec.max_shard]
    return list(range(spec.max_shard + 1 if num_files == -1 else min(num_files, spec.max_shard + 1)))


def download_shards(num_files: int, data_dir: str | None = None, base_url: str | None = None,
                    num_workers: int = 4, corpus: str = DEFAULT_CORPUS, **fetch_kwargs) -> list[str]:
    """Download the shards of `-n num_files` (shards_to_fetch) of a corpus on num_workers threads, into
    data_dir (default: the corpus's own). Returns the names that failed; OfflineError (after every worker has
    tried once) when the source cannot be reached at all, with what to do offline."""
    data_dir = get_data_dir(data_dir, corpus)
    base_url = base_url or os.environ.get(BASE_URL_ENV) or get_corpus(corpus).base_url
    storage.makedirs(data_dir)
    if storage.exists(storage.join(data_dir, CORPUS_INFO_FILE)):
        raise ValueError(f"{data_dir} holds a corpus built from local text ({CORPUS_INFO_FILE}); downloading "
                         f"{corpus} into it would mix the two. Use another --data-dir or JAXCHAT_BASE_DIR.")
    indices = shards_to_fetch(num_files, corpus)
    count = len(indices)
    progress = Progress()
    progress.line(f"{count} shards from {base_url} into {data_dir} with {num_workers} workers")
    lock = threading.Lock()
    tally = {"bytes": 0, "finished": 0, "failed": [], "offline": None}
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
                                        **fetch_kwargs)
            size_mb = storage.size(storage.join(data_dir, name)) / 1e6
            what = f"{size_mb:,.1f} MB in {time.monotonic() - t0:.1f}s" if downloaded else "already complete"
            progress.line(f"{name}: {what}")
        except DownloadError as e:
            with lock:
                tally["failed"].append(name)
                if isinstance(e, OfflineError):
                    tally["offline"] = e
            progress.line(f"{name}: FAILED: {e}")
        with lock:
            tally["finished"] += 1
        show_status(force=True)

    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        list(pool.map(fetch_one, indices))
    failed = sorted(tally["failed"])
    progress.close(f"done: {count - len(failed)}/{count} shards in {data_dir}, {tally['bytes'] / 1e6:,.1f} MB "
                   f"downloaded in {time.monotonic() - start:.1f}s")
    if tally["offline"] is not None:
        raise OfflineError(
            f"{tally['offline']}. Offline, build shards from text on this machine instead: python -m jaxchat.dataset "
            f"--builtin (Python's own documentation) or --from-text PATH; or copy shards into {data_dir}, or "
            f"download from a mirror you can reach (--base-url, ${BASE_URL_ENV})", tally["offline"].reason) from tally["offline"]
    return failed
