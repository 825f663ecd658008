"""When a checkpoint step is damaged, and when a failed read is not the step's fault.

A step is damaged only when its own files prove it: an item or its metadata missing, a JSON file that does
not parse, an array file shorter than its index says or whose compressed stream does not decode. Then
'latest' may skip it (it is kept where it is, never deleted). Any other failure while reading (the device
out of memory while resuming on fewer devices, EIO or ESTALE from a network filesystem, a permission) says
nothing about the step: the run stops with one line and nothing is skipped, moved or deleted, so that
rerunning the same command once the cause is gone resumes from the same step.

Orbax reads arrays through TensorStore, whose errors are ValueErrors whose message starts with an absl
status code; TensorStore maps each errno to one (ENOENT NOT_FOUND, EACCES PERMISSION_DENIED, ENOSPC and
out-of-memory RESOURCE_EXHAUSTED, EIO UNKNOWN, ESTALE ABORTED, EAGAIN UNAVAILABLE) and reports contents
that contradict the step's index as OUT_OF_RANGE (a file cut short), DATA_LOSS or FAILED_PRECONDITION (a
compressed stream cut short or corrupt). Measured on this Orbax (tests/test_checkpoint.py's damage cases):
a truncated array file OUT_OF_RANGE, a deleted or corrupted one FAILED_PRECONDITION.
"""

import json
import os
import re

import orbax.checkpoint as ocp
from etils import epath

from jaxchat.checkpoint_meta import StepUnreadableError, step_meta_file

# The status codes that say the step's bytes are not what its own index promised
DAMAGE_STATUS_CODES = frozenset({"OUT_OF_RANGE", "DATA_LOSS", "FAILED_PRECONDITION", "NOT_FOUND"})
# Python's own errors that say the same of a file jaxchat or Orbax reads directly (metadata, data state)
DAMAGE_ERRORS = (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError)
_STATUS = re.compile(r"^([A-Z_]+): ")


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def error_reason(error: BaseException) -> str:
    """One line for an error: its innermost cause (Orbax wraps tensorstore's ValueError, which says what
    is wrong with which file, in a bare Exception whose message is a page of TensorStore spec)."""
    *_, error = _chain(error)
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 300:  # tensorstore puts the path first and the reason ("No space left on device") last
        text = text[:140] + " ... " + text[-150:]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def is_damage(error: BaseException) -> bool:
    """Whether error, or one of its causes, proves the files being read incomplete or corrupt."""
    for e in _chain(error):
        if isinstance(e, DAMAGE_ERRORS):
            return True
        status = _STATUS.match(str(e)) if isinstance(e, ValueError) else None
        if status and status.group(1) in DAMAGE_STATUS_CODES:
            return True
    return False


# ---- whether a step is complete: read from its files by the process that decides --------------------------
# (Orbax's manager makes every read a collective, a barrier of all processes; these are read by process 0 alone.)

def read_step_meta(directory: str, step: int) -> dict:
    """The metadata of a step: the JSON file Orbax's JsonCheckpointHandler writes."""
    with open(step_meta_file(directory, step), encoding="utf-8") as f:
        return json.load(f)


def saved_structure(directory: str, step: int, item: str):
    """The saved tree of an array item (shapes, dtypes), from its metadata file."""
    return ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory) / str(step) / item).tree


def unreadable(directory: str, step: int, what: str, reason: str) -> StepUnreadableError:
    """The one line for a read that failed for a reason (error_reason) that is not the step's."""
    return StepUnreadableError(
        f"reading {what} of checkpoint step {step} in {directory} failed ({reason}); that does not make "
        "the step damaged, so nothing was skipped or moved. Remove the cause (out of device memory: resume on more "
        "devices, or with --fsdp; a filesystem error: check the mount), then run the same command again")


def step_problem(directory: str, step: int) -> str | None:
    """Why `step` is damaged (an item or metadata missing or unreadable), or None if it looks complete (its
    arrays are read by the restore). StepUnreadableError if reading failed for a reason that is not the step's."""
    step_dir = os.path.join(directory, str(step))
    if not os.path.isdir(os.path.join(step_dir, "meta")):
        return "its metadata is missing"
    try:
        meta = read_step_meta(directory, step)
    except Exception as e:  # noqa: BLE001 -- is_damage tells
        if not is_damage(e):
            raise unreadable(directory, step, "the metadata", error_reason(e)) from e
        return f"its metadata cannot be read ({error_reason(e)})"
    if not isinstance(meta, dict) or meta.get("step") != step or "model_config" not in meta or "items" not in meta:
        return "its metadata is not a jaxchat checkpoint's"
    for item in meta["items"]:
        if not os.path.isdir(os.path.join(step_dir, item)):
            return f"its {item} is missing"
        if item in ("params", "opt_state"):
            try:
                saved_structure(directory, step, item)
            except Exception as e:  # noqa: BLE001 -- whatever Orbax raises: is_damage tells
                if not is_damage(e):
                    raise unreadable(directory, step, f"the {item} metadata", error_reason(e)) from e
                return f"its {item} metadata cannot be read ({error_reason(e)})"
    return None
