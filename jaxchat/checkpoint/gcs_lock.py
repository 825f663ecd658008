"""One writer per run directory in a bucket (gs://): jaxchat.checkpoint.lock's rules, from object generations.

Every GCS object has a generation (a number that changes on each write of the object) and every write or delete
can carry a precondition on it; the server applies it atomically. That is all a lock needs:
- acquire: create `<dir>/run.lock` with if_generation_match=0 (only if absent). Refused (412): read the holder's
  record and its generation; if jaxchat.checkpoint.lock.gone_reason judges the holder gone (its heartbeat older than
  STALE_AFTER_S, an earlier start of this SLURM job, a dead pid on this host), take it over by rewriting the
  object with if_generation_match=<that generation>: of two runs taking over the same stale lock, exactly one
  wins, the other is refused and re-reads (now a live holder: RunLockedError). A record marked released (a run
  that ended cleanly) is taken without a message, as a local run.lock file left behind is.
- heartbeat (jaxchat.checkpoint.lock.Heartbeat, every HEARTBEAT_S): rewrite the record, heartbeat updated, with
  if_generation_match=<my generation>. Refused: another run took the lock (it judged this one gone): on_lost
  (default: one line, os._exit(EXIT_LOCK_LOST), no save). A passing error (network, 5xx, 429): try at the next beat.
  A refusal that is our own write landing twice (google-cloud-storage retries a conditional upload whose answer
  was lost) is recognised by the record's lock_id and adopted.
- release: rewrite the record as released with if_generation_match=<my generation> (refused: someone took it
  over, leave it alone), then delete that generation (if_generation_match). Two writes at exit, none per step.

Cost: one small object write every HEARTBEAT_S (30 s: ~2,900 class-A operations a day, ~$0.015/day at
$5/million), no listing. The heartbeat rule, as on NFS, trusts the hosts' clocks to agree to well within
STALE_AFTER_S (the record carries the holder's time.time()); the object's server-side `updated` time is there
too, should one judge by the server's clock instead (that needs the server's 'now').

fake-gcs-server (v1.54) enforces if_generation_match on uploads (simple, multipart and resumable) but NOT on
DELETE, copy/rewrite or metadata patches: release is therefore a conditional *upload* first (enforced
everywhere), the delete after it only tidies up.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable

from jaxchat.checkpoint.lock import (EXIT_LOCK_LOST, HEARTBEAT_S, LOCK_FILE, STALE_AFTER_S, Heartbeat, RunLockedError,
                                    RunLockError, describe, gone_reason, holder_record)

_ATTEMPTS = 5  # rounds of create / read / take over when the object changes under us (a race, not a wait)


def split_gs_url(url: str) -> tuple[str, str]:
    """'gs://bucket/a/b' -> ('bucket', 'a/b')."""
    if not url.startswith("gs://"):
        raise ValueError(f"not a gs:// URL: {url}")
    bucket, _, name = url[len("gs://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url}")
    return bucket, name.strip("/")


def storage_client():
    """A google-cloud-storage client; missing credentials become one RunLockError line (no traceback)."""
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage
    try:
        return storage.Client()
    except DefaultCredentialsError as e:
        raise RunLockError(
            "no Google Cloud credentials for a gs:// run directory: run `gcloud auth application-default login`, "
            "set GOOGLE_APPLICATION_CREDENTIALS to a service account key, or run on a VM whose service account "
            f"may read and write the bucket ({str(e).splitlines()[0]})") from None
    except OSError as e:  # project detection that asked the metadata server
        raise RunLockError(f"cannot reach Google Cloud Storage for the run directory's lock ({e})") from None


def _exceptions():
    from google.api_core import exceptions
    return exceptions


class GcsRunLock:
    """Holds `gs://…/run.lock` while open, its heartbeat renewed every `heartbeat_s`; close() releases it."""

    def __init__(self, blob_factory: Callable[[], object], url: str, record: dict, generation: int,
                 heartbeat_s: float = HEARTBEAT_S, on_lost: Callable[[], None] | None = None):
        self._blob, self.path, self._record, self.generation = blob_factory, url, record, generation
        self._on_lost = on_lost or self._stop_the_run
        self._closed = False
        self._heartbeat = Heartbeat(self.renew, heartbeat_s, self._on_lost)

    def renew(self) -> bool:
        """One heartbeat: False if another run took the lock over, else the record rewritten (or a passing error
        left for the next beat)."""
        ex = _exceptions()
        record = {**self._record, "heartbeat": round(time.time(), 1)}
        try:
            self.generation = _write(self._blob(), record, self.generation)
            self._record = record
            return True
        except ex.PreconditionFailed:
            pass
        except (ex.GoogleAPICallError, ex.RetryError, OSError):
            return True  # a passing error: the next beat tries again
        # refused: ours landed already (a retried upload), the object was deleted by a person, or another run took it
        try:
            current, generation = _read(self._blob())
        except (ex.GoogleAPICallError, ex.RetryError, OSError):
            return True
        if current is None:  # deleted by a person: no other writer; make it again (refused if one just did)
            try:
                self.generation = _write(self._blob(), record, 0)
                self._record = record
                return True
            except ex.PreconditionFailed:
                return False
        if current.get("lock_id") == self._record["lock_id"] and not current.get("released"):
            self.generation = generation
            return True
        return False

    def _stop_the_run(self) -> None:
        print(f"error: {self.path} was taken over by another run, which judged this one gone: stopping at once, "
              "without saving, so that the two do not both write this run directory", file=sys.stderr, flush=True)
        os._exit(EXIT_LOCK_LOST)

    def close(self) -> None:
        """Stops the heartbeat, marks the record released (only if still ours), then deletes that generation."""
        if self._closed:
            return
        self._closed = True
        self._heartbeat.stop()
        ex = _exceptions()
        try:
            released = _write(self._blob(), {**self._record, "released": True, "heartbeat": round(time.time(), 1)},
                              self.generation)
        except ex.PreconditionFailed:
            return  # another run holds it now: not ours to release
        except (ex.GoogleAPICallError, ex.RetryError, OSError) as e:
            print(f"warning: could not release {self.path} ({e}); the next run takes it over after "
                  f"{STALE_AFTER_S:.0f} s", file=sys.stderr, flush=True)
            return
        try:
            self._blob().delete(if_generation_match=released)
        except (ex.PreconditionFailed, ex.NotFound):
            pass
        except (ex.GoogleAPICallError, ex.RetryError, OSError):
            pass  # a released record left behind is taken without a word by the next run


def _write(blob, record: dict, if_generation_match: int) -> int:
    """Writes `record` to `blob` only if its generation is `if_generation_match` (0: only if absent); the new
    generation. PreconditionFailed if not."""
    blob.upload_from_string(json.dumps(record), content_type="application/json",
                            if_generation_match=if_generation_match)
    return int(blob.generation)


def _read(blob) -> tuple[dict | None, int | None]:
    """(record, generation) of the lock object as one version; (None, None) if absent. One GET: the generation is
    the response's x-goog-generation header (google-cloud-storage sets blob.generation from it), so the record and
    the generation are of the same version (a reload() then a download could straddle another's write)."""
    ex = _exceptions()
    try:
        data = blob.download_as_bytes()
        generation = int(blob.generation)
    except ex.NotFound:
        return None, None
    try:
        record = json.loads(data.decode() or "{}")
    except ValueError:
        record = {}
    return (record if isinstance(record, dict) else {}), generation


def acquire_gcs_run_lock(directory: str, heartbeat_s: float = HEARTBEAT_S, client=None,
                         on_lost: Callable[[], None] | None = None, now: Callable[[], float] = time.time
                         ) -> GcsRunLock:
    """The lock of gs:// `directory`, or RunLockedError at once if a live run holds it; a lock whose holder is
    provably gone is taken over, with one line saying so. Nothing to create first: an object store has no
    directories."""
    ex = _exceptions()
    bucket_name, prefix = split_gs_url(directory.rstrip("/"))
    name = f"{prefix}/{LOCK_FILE}" if prefix else LOCK_FILE
    url = f"gs://{bucket_name}/{name}"
    bucket = (client or storage_client()).bucket(bucket_name)

    def blob():
        return bucket.blob(name)

    record = {**holder_record(), "lock_id": uuid.uuid4().hex}
    for _ in range(_ATTEMPTS):
        try:
            generation = _write(blob(), record, 0)
            return GcsRunLock(blob, url, record, generation, heartbeat_s, on_lost)
        except ex.PreconditionFailed:
            pass
        except ex.Forbidden as e:
            raise RunLockError(f"cannot write {url}: {e.message} (the credentials need roles/storage.objectAdmin "
                               "on the bucket)") from None
        except ex.NotFound:
            raise RunLockError(f"bucket gs://{bucket_name} does not exist (create it: gcloud storage buckets "
                               f"create gs://{bucket_name} --location=<the region of your VMs>)") from None
        holder, generation = _read(blob())
        if holder is None:
            continue  # released between our create and our read: create again
        if holder.get("released"):
            reason = None
        else:
            reason = gone_reason(holder, record, now())
            if reason is None:
                raise RunLockedError(
                    f"{directory} is in use by another run ({describe(holder)}; lock object {url}): wait for it to "
                    "finish or stop it, or train under another --model-tag")
        record = {**record, "heartbeat": round(time.time(), 1)}
        try:
            generation = _write(blob(), record, generation)
        except ex.PreconditionFailed:
            continue  # its holder beat, released, or another run took it over first: judge again
        if reason is not None:
            print(f"Took over the lock of {directory} from {describe(holder)}: {reason}", flush=True)
        return GcsRunLock(blob, url, record, generation, heartbeat_s, on_lost)
    raise RunLockedError(f"{url} changed {_ATTEMPTS} times while this run tried to take it (other runs starting on "
                         "the same directory): start again")
