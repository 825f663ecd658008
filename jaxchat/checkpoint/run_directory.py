"""A run directory as the filesystem holds it, and the moves a run makes in it.

    <run dir>/<step>/                           a complete step (Orbax names a save by its number only once it is whole)
    <run dir>/<step>.orbax-checkpoint-tmp-<t>   a save that was interrupted, or is being written
    gs://.../<run dir>/<step>/                  in a bucket, where a rename is a copy: a save is written under its
                                                number and complete once Orbax wrote its commit_success.txt, last
    <run dir>/run.lock                          the lock of the run writing here (jaxchat.checkpoint.lock)
    <run dir>/replaced/<step>/                  steps set aside by --overwrite, deleted once the new run's first
                                                checkpoint is complete
    <run dir>/damaged/<step>/                   damaged steps, never deleted by jaxchat: moved here by a training
                                                run as soon as it finds them damaged (a restore that reads their
                                                arrays), or when it sets them aside or saves their number again

Every path goes through jaxchat.storage (a local disk or gs://). Each function reads or changes what the calling
process sees. In a run of several processes
jaxchat.checkpoint.manager calls them on process 0 only (jaxchat.distributed.multihost.decided_by_process_0) and every process
acts on that reading, so that the caches of a shared filesystem cannot split the processes' decisions.
Nothing here deletes a step: steps are moved, and only replaced/ is deleted, once the run that set them aside
has a complete step of its own. A step in replaced/ was judged complete; one judged damaged, from its metadata
here or from its arrays by a restore (jaxchat.checkpoint.manager), goes to damaged/ and stays there. A run never
replaces a step it was not told to: a new run where steps exist, or a resume from an older step than the
newest complete one, needs --overwrite (decide_start).
"""

import os
import re

from jaxchat.checkpoint.damage import step_problem
from jaxchat.checkpoint.meta import LATEST, CheckpointError, NoCheckpointError
from jaxchat.common import base_dir_hint
from jaxchat.checkpoint.lock import LOCK_FILE
from jaxchat import storage

REPLACED_SUBDIR = "replaced"
DAMAGED_SUBDIR = "damaged"
_UNFINISHED = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
COMMIT_MARKER = "commit_success.txt"  # Orbax's last file of a save in a bucket (orbax/checkpoint/_src/path/atomicity.py)


def _numbered(directory: str) -> list[str]:
    """The names of directory's numbered subdirectories, as the storage lists them ([] without the directory)."""
    if not storage.isdir(directory):
        return []
    return [name for name in storage.listdir(directory)
            if name.isdigit() and storage.isdir(storage.join(directory, name))]


def _committed(directory: str, name: str) -> bool:
    """Whether a numbered directory is a whole save: on a disk, any (Orbax renames a save to its number once it is
    whole); in a bucket, one with Orbax's commit marker."""
    return not storage.is_url(directory) or storage.exists(storage.join(directory, name, COMMIT_MARKER))


def step_numbers(directory: str) -> list[int]:
    """The steps of a run directory, complete or damaged, in order (unfinished saves are not steps)."""
    return sorted(int(name) for name in _numbered(directory) if _committed(directory, name))


def unfinished_saves(directory: str) -> list[str]:
    """The saves that have not completed (interrupted, or being written): Orbax's temporary directories on a
    disk, the numbered directories without a commit marker in a bucket."""
    if storage.is_url(directory):
        return sorted(name for name in _numbered(directory) if not _committed(directory, name))
    if not storage.isdir(directory):
        return []
    return sorted(name for name in storage.listdir(directory) if _UNFINISHED.match(name))


def holds_steps_set_aside(directory: str) -> bool:
    replaced = storage.join(directory, REPLACED_SUBDIR)
    return storage.isdir(replaced) and bool(storage.listdir(replaced))


def unused_path(path: str) -> str:
    """path, or path-2, path-3, ... whichever does not exist yet."""
    candidate, n = path, 1
    while storage.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def move_steps(directory: str, steps: list[int], subdir: str) -> list[str]:
    """Moves steps into directory/subdir (a name already taken there gets -2, -3, ...); returns the new paths."""
    moved = []
    if steps:
        storage.makedirs(storage.join(directory, subdir))
    for step in steps:
        target = unused_path(storage.join(directory, subdir, str(step)))
        storage.move(storage.join(directory, str(step)), target)
        moved.append(target)
    return moved


def remove_if_unused(directory: str) -> bool:
    """Removes a run directory that holds nothing but its lock file (a start that failed before saving
    anything); True if it did. Anything else there (steps, unfinished saves, replaced/) keeps it."""
    try:
        if set(storage.listdir(directory)) - {LOCK_FILE}:
            return False
        if storage.exists(storage.join(directory, LOCK_FILE)):
            storage.remove(storage.join(directory, LOCK_FILE))
        if not storage.is_url(directory):  # (a bucket's 'directory' goes with its last object)
            os.rmdir(directory)
    except OSError:  # gone already, or something appeared meanwhile: leave it
        return False
    return True


def holds_a_model(run_dir: str) -> bool:
    """Whether a run directory has a step with its metadata (what loading a model needs; load_model checks the
    rest): a directory left by a start that saved nothing is not a model."""
    return any(storage.isdir(storage.join(run_dir, str(step), "meta")) for step in step_numbers(run_dir))


def _no_checkpoints(directory: str) -> NoCheckpointError:
    return NoCheckpointError(f"No checkpoints at {directory}{base_dir_hint(directory)}: train a model first "
                             "(python -m scripts.train)")


def find_model_tag(checkpoints_root: str) -> str:
    """The run to load when none is named, as nanochat picks it: among the run directories that hold a model,
    the deepest d<N>, else the most recently written one."""
    if not storage.isdir(checkpoints_root):
        raise _no_checkpoints(checkpoints_root)
    tags = [t for t in storage.listdir(checkpoints_root) if holds_a_model(storage.join(checkpoints_root, t))]
    if not tags:
        raise _no_checkpoints(checkpoints_root)
    depths = [(int(m.group(1)), t) for t in tags if (m := re.fullmatch(r"d(\d+)", t))]
    if depths:
        return max(depths)[1]
    return max(tags, key=lambda t: storage.getmtime(storage.join(checkpoints_root, t)))


def restore_candidates(directory: str, step: int | str) -> list[int]:
    """The steps a restore of `step` tries, in order: that step, or for LATEST every step, newest first (the
    restore skips the damaged ones). NoCheckpointError if there is none."""
    steps = step_numbers(directory)
    if step == LATEST:
        if not steps:
            raise NoCheckpointError(f"No checkpoints in {directory}: nothing to resume from")
        return list(reversed(steps))
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be a step number or '{LATEST}', got {step!r}")
    if step not in steps:
        raise NoCheckpointError(f"No checkpoint step {step} in {directory}; steps there: {steps}")
    return [step]


# ---- the decisions of a run about its directory (made by process 0: jaxchat.checkpoint.manager) ----------------------

def decide_start(directory: str, resume_from_step: int | str, overwrite: bool) -> dict:
    """What a start does: {resume: the step to restore, LATEST or None (a new run); set_aside: the steps to move
    out of its way once the weights are read; replaces_set_aside: steps an earlier --overwrite start set aside
    are this run's to delete}. CheckpointError, one line, where it would replace steps unasked: a new run where
    steps exist, or a resume from an older step than the newest complete one, without --overwrite."""
    steps = step_numbers(directory)
    set_aside_before = overwrite and holds_steps_set_aside(directory)
    if resume_from_step == LATEST and steps:
        return {"resume": LATEST, "set_aside": [], "replaces_set_aside": False}
    if resume_from_step in (-1, LATEST):  # a new run ('latest' with nothing saved: a requeued job's first start)
        if resume_from_step == LATEST:
            print(f"No checkpoint in {directory} yet: starting from scratch", flush=True)
        if steps and not overwrite:
            raise CheckpointError(
                f"{directory} holds the checkpoints of an earlier run (steps {steps}): resume it with "
                "--resume-from-step latest, pick another --model-tag, or pass --overwrite to replace them "
                "(they are deleted once this run's first checkpoint is complete)")
        if not overwrite and holds_steps_set_aside(directory):
            replaced = storage.join(directory, REPLACED_SUBDIR)
            raise CheckpointError(
                f"{replaced} holds the checkpoints of a run that an --overwrite run replaced before saving "
                f"any: pass --overwrite to replace them, or move them back into {directory} to resume them")
        return {"resume": None, "set_aside": steps, "replaces_set_aside": set_aside_before}
    restore_candidates(directory, resume_from_step)  # the step exists
    complete = [s for s in steps if s > resume_from_step and step_problem(directory, s) is None]
    if complete and not overwrite:
        raise CheckpointError(
            f"--resume-from-step {resume_from_step}: {directory} holds newer complete steps {complete}, which a run "
            f"resumed from step {resume_from_step} would replace. Resume the newest with --resume-from-step latest, or "
            "pass --overwrite too to set them aside (deleted once this run's first checkpoint is complete)")
    newer = [s for s in steps if s > resume_from_step]
    return {"resume": resume_from_step, "set_aside": newer if overwrite else [], "replaces_set_aside": set_aside_before}


def set_aside(directory: str, steps: list[int]) -> dict:
    """Moves steps out of a run's way: complete ones into replaced/, damaged ones into damaged/. (Damage is read
    from the files' metadata here; a step whose arrays a restore found damaged was moved into damaged/ then.)
    {complete: [...], damaged: [...]}."""
    complete = [s for s in steps if step_problem(directory, s) is None]
    found_damaged = [s for s in steps if s not in complete]
    move_steps(directory, complete, REPLACED_SUBDIR)
    move_steps(directory, found_damaged, DAMAGED_SUBDIR)
    return {"complete": complete, "damaged": found_damaged}


def clear_steps_from(directory: str, step: int) -> list[tuple[int, str]]:
    """Makes room for saving `step`: damaged steps of that number or newer are moved into damaged/ ([(step, new
    path)]); a complete one is never replaced (CheckpointError)."""
    newer = [s for s in step_numbers(directory) if s >= step]
    in_the_way = [s for s in newer if step_problem(directory, s) is not None]
    complete = [s for s in newer if s not in in_the_way]
    if complete:
        raise CheckpointError(
            f"saving step {step} would replace the complete checkpoint step(s) {complete} in {directory}: not done "
            "(did another run write there? each holds the directory's lock unless --no-lock)")
    return list(zip(in_the_way, move_steps(directory, in_the_way, DAMAGED_SUBDIR)))


def newest_complete_step(directory: str) -> int | None:
    return next((s for s in reversed(step_numbers(directory)) if step_problem(directory, s) is None), None)


def delete_set_aside_once_complete(directory: str, step: int) -> bool:
    """Deletes replaced/ if `step` is complete on disk (the run's first save); False: kept, try at the next save."""
    if step_problem(directory, step) is not None:
        return False
    storage.rmtree(storage.join(directory, REPLACED_SUBDIR))
    return True
