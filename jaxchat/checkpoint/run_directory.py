"""A run directory as the filesystem holds it, and the moves a run makes in it.

    <run dir>/<step>/                           a complete step (Orbax names a save by its number only once it is whole)
    <run dir>/<step>.orbax-checkpoint-tmp-<t>   a save that was interrupted, or is being written
    <run dir>/run.lock                          the lock of the run writing here (jaxchat.checkpoint.lock)
    <run dir>/replaced/<step>/                  steps set aside by --overwrite, deleted once the new run's first
                                                checkpoint is complete
    <run dir>/damaged/<step>/                   damaged steps, never deleted by jaxchat: moved here by a training
                                                run as soon as it finds them damaged (a restore that reads their
                                                arrays), or when it sets them aside or saves their number again

Each function reads or changes what the calling process sees. In a run of several processes
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
import shutil

from jaxchat.checkpoint.damage import step_problem
from jaxchat.checkpoint.meta import LATEST, CheckpointError, NoCheckpointError
from jaxchat.common import base_dir_hint
from jaxchat.checkpoint.lock import LOCK_FILE

REPLACED_SUBDIR = "replaced"
DAMAGED_SUBDIR = "damaged"
_UNFINISHED = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")


def step_numbers(directory: str) -> list[int]:
    """The steps of a run directory, complete or damaged, in order (unfinished saves are not steps)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory)
                  if name.isdigit() and os.path.isdir(os.path.join(directory, name)))


def unfinished_saves(directory: str) -> list[str]:
    """Orbax's temporary directories of saves that have not completed (interrupted, or being written)."""
    if not os.path.isdir(directory):
        return []
    return sorted(name for name in os.listdir(directory) if _UNFINISHED.match(name))


def holds_steps_set_aside(directory: str) -> bool:
    replaced = os.path.join(directory, REPLACED_SUBDIR)
    return os.path.isdir(replaced) and bool(os.listdir(replaced))


def unused_path(path: str) -> str:
    """path, or path-2, path-3, ... whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


def move_steps(directory: str, steps: list[int], subdir: str) -> list[str]:
    """Moves steps into directory/subdir (a name already taken there gets -2, -3, ...); returns the new paths."""
    moved = []
    if steps:
        os.makedirs(os.path.join(directory, subdir), exist_ok=True)
    for step in steps:
        target = unused_path(os.path.join(directory, subdir, str(step)))
        os.rename(os.path.join(directory, str(step)), target)
        moved.append(target)
    return moved


def remove_if_unused(directory: str) -> bool:
    """Removes a run directory that holds nothing but its lock file (a start that failed before saving
    anything); True if it did. Anything else there (steps, unfinished saves, replaced/) keeps it."""
    try:
        if set(os.listdir(directory)) - {LOCK_FILE}:
            return False
        if os.path.exists(os.path.join(directory, LOCK_FILE)):
            os.remove(os.path.join(directory, LOCK_FILE))
        os.rmdir(directory)
    except OSError:  # gone already, or something appeared meanwhile: leave it
        return False
    return True


def holds_a_model(run_dir: str) -> bool:
    """Whether a run directory has a step with its metadata (what loading a model needs; load_model checks the
    rest): a directory left by a start that saved nothing is not a model."""
    return any(os.path.isdir(os.path.join(run_dir, str(step), "meta")) for step in step_numbers(run_dir))


def _no_checkpoints(directory: str) -> NoCheckpointError:
    return NoCheckpointError(f"No checkpoints at {directory}{base_dir_hint(directory)}: train a model first "
                             "(python -m scripts.train)")


def find_model_tag(checkpoints_root: str) -> str:
    """The run to load when none is named, as nanochat picks it: among the run directories that hold a model,
    the deepest d<N>, else the most recently written one."""
    if not os.path.isdir(checkpoints_root):
        raise _no_checkpoints(checkpoints_root)
    tags = [t for t in os.listdir(checkpoints_root) if holds_a_model(os.path.join(checkpoints_root, t))]
    if not tags:
        raise _no_checkpoints(checkpoints_root)
    depths = [(int(m.group(1)), t) for t in tags if (m := re.fullmatch(r"d(\d+)", t))]
    if depths:
        return max(depths)[1]
    return max(tags, key=lambda t: os.path.getmtime(os.path.join(checkpoints_root, t)))


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
            replaced = os.path.join(directory, REPLACED_SUBDIR)
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
    shutil.rmtree(os.path.join(directory, REPLACED_SUBDIR))
    return True
