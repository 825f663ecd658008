"""When a checkpoint step is damaged, and when a failed read is not the step's fault.

A step is damaged only when its own files prove it: an error about a file inside the step directory that
says the file is missing, does not parse, is shorter than its index says or holds a compressed stream that
does not decode. Then 'latest' may skip it (jaxchat.checkpoint.manager: a training run moves it into damaged/, where
jaxchat never deletes it). Any other failure while reading (the device out of memory while resuming on fewer
devices, EIO or ESTALE from a network filesystem, a permission) says nothing about the step, and neither does
the same error about another file (a data shard that the loader re-reads on resume, which jaxchat.checkpoint.manager
judges apart: jaxchat.data.shards.DataError): the run stops with one line and nothing is skipped, moved or deleted,
so that rerunning the same command once the cause is gone resumes from the same step.

Orbax reads arrays through TensorStore, whose errors are ValueErrors whose message starts with an absl
status code; TensorStore maps each errno to one (ENOENT NOT_FOUND, EACCES PERMISSION_DENIED, ENOSPC and
out-of-memory RESOURCE_EXHAUSTED, EIO UNKNOWN, ESTALE ABORTED, EAGAIN UNAVAILABLE) and reports contents
that contradict the step's index as OUT_OF_RANGE (a file cut short), DATA_LOSS or FAILED_PRECONDITION (a
compressed stream cut short or corrupt). Measured on this Orbax (tests/test_checkpoint.py's damage cases):
a truncated array file OUT_OF_RANGE, a deleted or corrupted one FAILED_PRECONDITION.
"""

import contextlib
import json
import os
import re

import orbax.checkpoint as ocp
from etils import epath

from jaxchat.checkpoint.meta import StepUnreadableError, step_meta_file
from jaxchat import storage
from jaxchat.common import error_chain, error_reason

# The status codes that say the step's bytes are not what its own index promised
DAMAGE_STATUS_CODES = frozenset({"OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND"})
_STATUS = re.compile(r"^([A-Z_]+): ")


class StepFileError(ValueError):
    """A file of a step that does not decode (JSON, UTF-8): Python's decode errors name no file, so a read of
    the step's own files (reading_step_files) raises them as this, naming the file or item read."""

    def __init__(self, filename: str):
        super().__init__(f"{filename} does not decode")
        self.filename = filename


@contextlib.contextmanager
def reading_step_files(path: str):
    """Around a read of files under `path` (a step's file or item) and nothing else: a decode error there is
    theirs, raised as StepFileError(path) (its cause kept, for error_reason)."""
    try:
        yield
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StepFileError(path) from e


def _names_a_file_in(error: BaseException, step_dir: str) -> bool:
    """Whether error is about a file inside step_dir: by its filename (Python's OSErrors, StepFileError) or its
    message (Orbax's FileNotFoundError and TensorStore's errors name the path in their text)."""
    inside = storage.join(storage.absolute(step_dir), "")
    filename = getattr(error, "filename", None)
    if storage.is_url(inside):  # gcsfs names an object 'bucket/name', tensorstore 'gs://bucket/name'
        bare = inside.split("://", 1)[1]
        return (filename is not None and str(filename).split("://", 1)[-1].startswith(bare)) or bare in str(error)
    return (filename is not None and os.path.join(os.path.abspath(str(filename)), "").startswith(inside)) or \
        inside in str(error)


def is_damage(error: BaseException, step_dir: str) -> bool:
    """Whether error, or one of its causes, proves a file inside step_dir (the step's own) missing, cut short or
    corrupt. The same errors about any other file (a data shard, the tokenizer) say nothing about the step."""
    for e in error_chain(error):
        status = _STATUS.match(str(e)) if isinstance(e, ValueError) else None
        proof = isinstance(e, (FileNotFoundError, NotADirectoryError, StepFileError)) or \
            bool(status and status.group(1) in DAMAGE_STATUS_CODES)
        if proof and _names_a_file_in(e, step_dir):
            return True
    return False


# ---- whether a step is complete: read from its files by the process that decides --------------------------
# (Orbax's manager makes every read a collective, a barrier of all processes; these are read by process 0 alone.)

def read_step_meta(directory: str, step: int) -> dict:
    """The metadata of a step: the JSON file Orbax's JsonCheckpointHandler writes."""
    path = step_meta_file(directory, step)
    with storage.open_file(path, encoding="utf-8") as f, reading_step_files(path):
        return json.load(f)


def saved_structure(directory: str, step: int, item: str):
    """The saved tree of an array item (shapes, dtypes), from its metadata file."""
    path = storage.join(directory, str(step), item)
    with reading_step_files(path):
        return ocp.PyTreeCheckpointHandler().metadata(epath.Path(path)).tree


def unreadable(directory: str, step: int, what: str, reason: str) -> StepUnreadableError:
    """The one line for a read that failed for a reason (error_reason) that is not the step's."""
    return StepUnreadableError(
        f"reading {what} of checkpoint step {step} in {directory} failed ({reason}); that does not make "
        "the step damaged, so nothing was skipped or moved. Remove the cause (out of device memory: resume on more "
        "devices, or with --fsdp; a filesystem error: check the mount), then run the same command again")


def step_problem(directory: str, step: int) -> str | None:
    """Why `step` is damaged (an item or metadata missing or unreadable), or None if it looks complete (its
    arrays are read by the restore). StepUnreadableError if reading failed for a reason that is not the step's."""
    step_dir = storage.join(directory, str(step))
    if not storage.isdir(storage.join(step_dir, "meta")):
        return "its metadata is missing"
    try:
        meta = read_step_meta(directory, step)
    except Exception as e:  # noqa: BLE001 -- is_damage tells
        if not is_damage(e, step_dir):
            raise unreadable(directory, step, "the metadata", error_reason(e)) from e
        return f"its metadata cannot be read ({error_reason(e)})"
    if not isinstance(meta, dict) or meta.get("step") != step or "model_config" not in meta or "items" not in meta:
        return "its metadata is not a jaxchat checkpoint's"
    for item in meta["items"]:
        if not storage.isdir(storage.join(step_dir, item)):
            return f"its {item} is missing"
        if item in ("params", "opt_state"):
            try:
                saved_structure(directory, step, item)
            except Exception as e:  # noqa: BLE001 -- whatever Orbax raises: is_damage tells
                if not is_damage(e, step_dir):
                    raise unreadable(directory, step, f"the {item} metadata", error_reason(e)) from e
                return f"its {item} metadata cannot be read ({error_reason(e)})"
    return None
