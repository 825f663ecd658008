"""Checkpoints of a training run with Orbax: exact resume, on any mesh, safe against interruption.

One directory per run, `<base_dir>/base_checkpoints/<model_tag or d{depth}>/` (jaxchat.checkpoint.run_directory:
its layout and the moves made in it), one Orbax step directory per saved step holding
  params     the model parameters (an nnx.State of arrays)
  opt_state  the optimizer state (an optax pytree; it holds the step counts, so schedules resume)
  data       the train data iterator's state, one JSON file per process (grain's Orbax handler)
  meta       JSON: step, val_bpb, model_config, user_config, device_batch_size, max_seq_len,
             loop_state {min_val_bpb, smooth_train_loss, total_training_time}, tokenizer
             {vocab_size, sha256}, and the list of items saved

Saving is asynchronous: `save` returns once the arrays are copied off the devices (so the train
step may donate them) and the data iterator's state is written; Orbax writes the rest from a
background thread while training goes on. `wait` blocks until it is on disk; `close` waits too.

Nothing a user has trained is deleted by a message's advice, a typo or two processes disagreeing:
- One writer per run directory: a writer holds the directory's lock (jaxchat.checkpoint.lock, taken by process
  0) from its start to close(); a second run on it stops at once.
- Orbax writes a step under a temporary name and renames it when complete: an interrupted save never
  looks like a step.
- A step is damaged only when its own files prove it (jaxchat.checkpoint.damage); 'latest' skips it, and a
  training run moves it into damaged/ at once, where jaxchat never deletes it (so no later --overwrite start
  takes it for complete). A read that fails for any other reason (out of memory, an I/O error) stops the run
  and moves nothing. The data iterator's position is set apart from the arrays' restore: a shard the loader
  cannot re-read is the data's error (jaxchat.data.shards.DataError, naming the file and row group), never damage.
- A start decides once, before any compute, what it will do (plan_start): a new run where steps exist needs
  --overwrite, and so does resuming an older step than the newest complete one; the steps it would replace
  are set aside into replaced/ once the weights are read, and deleted only when the new run's first step
  is complete. A save never replaces a complete step.
- Every decision about the directory is process 0's, handed to every process (jaxchat.distributed.multihost).

Restoring takes target shardings: a run saved on 8 devices resumes on 1, 2 or 4, replicated or
FSDP, with the same values (Orbax reads each target shard from the saved chunks).
"""

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxchat.checkpoint import run_directory as rundir
from jaxchat.checkpoint.damage import (is_damage, read_step_meta, reading_step_files, saved_structure,
                                       step_problem, unreadable)
from jaxchat.checkpoint.meta import (CHECKPOINTS_SUBDIR, LATEST, TRAINING_META_KEYS, CheckpointError,
                                     CheckpointMismatchError, IncompleteCheckpointError, NoCheckpointError,
                                     SaveFailedError, StepUnreadableError, check_compatible, check_model_tag,
                                     default_model_tag)
from jaxchat import storage
from jaxchat.common import error_reason, get_base_dir, key_name, print0
from jaxchat.model.gpt import GPTConfig
from jaxchat.distributed.multihost import decided_by_process_0, gathered
from jaxchat.checkpoint.gcs_lock import acquire_gcs_run_lock
from jaxchat.checkpoint.lock import RunLockError, acquire_run_lock
from jaxchat.data.shards import DataError
from jaxchat.checkpoint.staged_files import check_writable_dir

# What every process raises alike when process 0 decided it (jaxchat.distributed.multihost.decided_by_process_0)
SHARED_ERRORS = (CheckpointError,)


# ---- paths and checks before training ------------------------------------------------------------

def checkpoint_dir(model_tag: str | None, depth: int | None = None, base_dir: str | None = None) -> str:
    """`<base_dir>/base_checkpoints/<model_tag or d{depth}>`, as nanochat. A tag that is not one safe directory
    name (check_model_tag) raises ValueError: no caller writes outside base_checkpoints/ (a training run's, an
    import's, a loaded model's)."""
    tag = default_model_tag(depth) if model_tag is None else check_model_tag(model_tag)
    return storage.join(base_dir or get_base_dir(), CHECKPOINTS_SUBDIR, tag)


def check_writable(directory: str, bytes_needed: int = 0) -> None:
    """Fails now, with what to do, if checkpoints could not be written to `directory` later. Makes nothing:
    the run directory is made by the run that takes it (RunCheckpoints). In a bucket: an object written and
    deleted under the directory (permissions and credentials; a bucket has no 'free space')."""
    if storage.is_url(directory):
        probe = storage.join(directory, ".write_test")
        try:
            storage.write_bytes(probe, b"")
            storage.remove(probe)
        except Exception as e:  # noqa: BLE001 -- gcsfs's HttpError (403, 404), StorageError (no credentials)
            raise CheckpointError(f"Cannot write checkpoints to {directory} ({error_reason(e)}): check the bucket's "
                                  "name and that these credentials may create and delete objects in it") from e
        return
    try:
        check_writable_dir(directory)
    except OSError as e:
        raise CheckpointError(
            f"Cannot write checkpoints to {directory} ({e.strerror or e}). Point $JAXCHAT_BASE_DIR at a "
            "writable directory, or fix the permissions, before training."
        ) from e
    existing = directory
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if bytes_needed > free:
        raise CheckpointError(
            f"A checkpoint needs about {bytes_needed / 1e9:.2f} GB but only {free / 1e9:.2f} GB are free under "
            f"{directory}. Free some space, keep fewer checkpoints, or set $JAXCHAT_BASE_DIR elsewhere."
        )


def _json_ready(meta: dict) -> dict:
    """A plain-JSON copy (numpy/jax scalars become Python numbers), so a bad value fails in `save`,
    not later in Orbax's background thread."""

    def convert(x):
        if isinstance(x, (np.generic, np.ndarray, jax.Array)) and np.ndim(x) == 0:
            return np.asarray(x).item()
        raise TypeError(f"checkpoint metadata holds a {type(x).__name__}, which is not JSON: {x!r}")

    return json.loads(json.dumps(meta, default=convert))


def _abstract_with_shardings(abstract, shardings):
    """ShapeDtypeStructs carrying the target shardings: what Orbax restores onto."""
    if shardings is None:
        def keep(x):
            if getattr(x, "sharding", None) is None:
                raise ValueError("restore needs target shardings: pass them, or abstract leaves that carry .sharding")
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return jax.tree.map(keep, abstract)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract, shardings)


def _signature(tree) -> dict[str, tuple[tuple, str]]:
    """{dotted path: (shape, dtype)} of every leaf; the same paths for a live tree and Orbax's metadata.
    The length of Muon's stacks is left out: it is padded to a multiple of the device count (jaxchat.optim.recipes
    ParamLayout), so a run restored on other devices re-pads them (zero matrices added or dropped)."""
    signature = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(key_name(k)) for k in path]
        shape = tuple(x.shape)
        if "muon" in names[:-1] and len(shape) == 3:
            shape = ("stack",) + shape[1:]
        signature[".".join(names)] = (shape, str(np.dtype(x.dtype)))
    return signature


def _describe_differences(saved: dict, wanted: dict, limit: int = 5) -> str:
    lines = [f"{path}: saved {saved.get(path, 'absent')}, expected {wanted.get(path, 'absent')}"
             for path in sorted(set(saved) | set(wanted)) if saved.get(path) != wanted.get(path)]
    more = f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else ""
    return "\n  ".join(lines[:limit]) + more


# ---- the checkpoint manager ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class StartPlan:
    """What a start does with its run directory, decided by process 0 before any compute (plan_start).

    resume: the step to restore (LATEST: the newest complete one), or None for a new run.
    set_aside: the steps to move out of the way once the weights are read (set_aside): an earlier run's
    (a new run with --overwrite) or those newer than the resumed step (--resume-from-step N --overwrite)."""

    resume: int | str | None
    set_aside: tuple[int, ...] = ()


class RunCheckpoints:
    """The checkpoints of one run in `directory`: one Orbax CheckpointManager saving the state (params,
    optimizer state), the data iterator's position and the metadata of a step together, as nanodo does;
    one check (the step complete, the model, tokenizer, structure and process count compatible) before
    any restore.

        ckpt = RunCheckpoints(directory, max_to_keep=3)
        plan = ckpt.plan_start(LATEST, overwrite=False)                 # refuses what would lose a step
        params, opt_state, meta = ckpt.restore(plan.resume, abstract_params, abstract_opt_state,
                                               param_shardings, opt_shardings, data_iter=train_iter,
                                               model_config=config, tokenizer=tokenizer)
        ckpt.set_aside(plan.set_aside)
        ckpt.save(step, params, opt_state, train_iter, meta)           # returns while Orbax writes
        ckpt.close()

    Every process calls every method (Orbax coordinates the writes; process 0 decides what the directory
    holds); messages print on process 0. Unless read_only, it holds the directory's lock until close()
    (lock=False: none, for filesystems without locks): CheckpointError at once if another process holds it.
    """

    def __init__(self, directory: str, max_to_keep: int | None = None, async_save: bool = True,
                 read_only: bool = False, lock: bool = True):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None to keep every step), got {max_to_keep}")
        self.directory = storage.absolute(directory)
        if read_only and not storage.isdir(self.directory):
            raise rundir._no_checkpoints(self.directory)
        self._lock = None
        self._read_only = read_only
        self._created = False  # this start made the directory: close() removes it if nothing was saved
        if not read_only:  # before anything in the directory is removed (Orbax's start-up cleaning below)
            self._created = self._take_directory(lock)
        self._replaced = False  # steps set aside in replaced/, until this run's first complete save
        self._saved = False
        self._saving: int | None = None  # the step of the save in flight
        unfinished = rundir.unfinished_saves(self.directory)
        if unfinished:
            # under the lock no live run writes here; a reader leaves them alone (a live run may be writing them)
            action = "ignoring unfinished save(s) {} (interrupted, or being written)" if read_only else \
                "removing unfinished save(s) {} (interrupted while being written)"
            print0(f"Checkpoints in {self.directory}: {action.format(', '.join(unfinished))}")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            create=not read_only,
        )
        handlers = {"params": ocp.StandardCheckpointHandler(), "opt_state": ocp.StandardCheckpointHandler(),
                    "data": grain.checkpoint.CheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def _take_directory(self, lock: bool) -> bool:
        """Process 0 makes the directory (if needed) and takes its lock; every process learns the outcome, so
        that all stop together with the same line. Returns whether the directory was made here."""

        def take() -> bool:
            existed = storage.isdir(self.directory)
            if lock:
                try:
                    acquire = acquire_gcs_run_lock if storage.is_url(self.directory) else acquire_run_lock
                    self._lock = acquire(self.directory)
                except RunLockError as e:
                    if not existed:  # made for the lock that could not be taken
                        rundir.remove_if_unused(self.directory)
                    raise CheckpointError(str(e)) from None
            else:
                storage.makedirs(self.directory)
            return not existed

        return decided_by_process_0("run directory", take, SHARED_ERRORS)

    # -- a start: what it resumes, what it sets aside --

    def plan_start(self, resume_from_step: int | str, overwrite: bool = False) -> StartPlan:
        """What this start does (a StartPlan: jaxchat.checkpoint.run_directory.decide_start), decided by process 0 before any
        compute; CheckpointError, one line, where it would replace steps unasked."""
        self._wait()
        plan = decided_by_process_0("start", lambda: rundir.decide_start(self.directory, resume_from_step, overwrite),
                                    SHARED_ERRORS)
        # steps an earlier --overwrite start set aside and saved nothing after: this run's first save replaces them
        self._replaced = self._replaced or plan["replaces_set_aside"]
        return StartPlan(plan["resume"], tuple(plan["set_aside"]))

    def set_aside(self, steps) -> None:
        """Moves steps out of the way of this run (after its weights are read): complete ones into replaced/,
        deleted once this run's first checkpoint is complete; damaged ones into damaged/, kept."""
        if not steps:
            return
        moved = decided_by_process_0("set aside", lambda: rundir.set_aside(self.directory, list(steps)), SHARED_ERRORS)
        self._manager.reload()
        if moved["complete"]:
            print0(f"--overwrite: checkpoint step(s) {moved['complete']} are moved to "
                   f"{storage.join(self.directory, rundir.REPLACED_SUBDIR)}, and deleted once this run's first "
                   "checkpoint is complete")
            self._replaced = True
        if moved["damaged"]:
            print0(f"Moved damaged checkpoint step(s) {moved['damaged']} to "
                   f"{storage.join(self.directory, rundir.DAMAGED_SUBDIR)} (kept, not deleted)")

    # -- saving --

    def save(self, step: int, params, opt_state, data_iter, meta: dict) -> None:
        """Saves `step` asynchronously. opt_state or data_iter may be None for a weights-only step
        (an imported model); a training checkpoint needs every key of TRAINING_META_KEYS in meta.
        The data iterator's state is taken now, so save before drawing the next batch.
        A damaged step of the same number or newer (one that a resumed run skipped) is moved into damaged/
        first; a complete one is never replaced (CheckpointError). SaveFailedError if writing fails (here
        or, for the step before, in Orbax's background thread)."""
        items = ["params"] + (["opt_state"] if opt_state is not None else []) + (["data"] if data_iter is not None else [])
        required = TRAINING_META_KEYS if opt_state is not None else ("model_config",)
        missing = [key for key in required if key not in meta]
        if missing:
            raise ValueError(f"checkpoint metadata lacks {missing}; a resumable checkpoint needs {list(required)} "
                             "('tokenizer': tokenizer_info(tokenizer))")
        meta = _json_ready({**meta, "step": step, "items": items})
        self._clear_steps_from(step)
        args = {"params": ocp.args.StandardSave(params), "meta": ocp.args.JsonSave(meta)}
        if opt_state is not None:
            args["opt_state"] = ocp.args.StandardSave(opt_state)
        if data_iter is not None:
            args["data"] = grain.checkpoint.CheckpointSave(data_iter)
        try:  # (the previous save is complete: _clear_steps_from waited for it)
            self._manager.save(step, args=ocp.args.Composite(**args), force=True)
        except Exception as e:  # noqa: BLE001 -- whatever the write met (ENOSPC is tensorstore's ValueError)
            raise self._save_failed(e, step) from e
        self._saving, self._saved = step, True
        if self._replaced:
            self._delete_replaced(step)

    def _clear_steps_from(self, step: int) -> None:
        """Makes room for `step`: damaged steps of that number or newer are moved into damaged/."""
        self._wait()
        moved = decided_by_process_0("clear steps", lambda: rundir.clear_steps_from(self.directory, step), SHARED_ERRORS)
        for damaged, target in moved:
            print0(f"Moved damaged checkpoint step {damaged} to {target} to save this run's step {step} (kept, not deleted)")
        self._manager.reload()

    def _delete_replaced(self, step: int) -> None:
        """Once this run's first save is complete and reads back, the steps it set aside go."""
        self._wait()
        if decided_by_process_0("delete replaced", lambda: rundir.delete_set_aside_once_complete(self.directory, step),
                                SHARED_ERRORS):
            print0(f"Deleted the replaced checkpoints in {storage.join(self.directory, rundir.REPLACED_SUBDIR)}: "
                   f"this run's step {step} is complete")
            self._replaced = False

    def _save_failed(self, error: Exception, step: int | None) -> SaveFailedError:
        newest = self.newest_committed_step()
        newest = f"step {newest} stays the newest complete checkpoint" if newest is not None else \
            "no complete checkpoint is left"
        return SaveFailedError(
            f"saving checkpoint step {step} in {self.directory} failed ({error_reason(error)}); {newest}. "
            "Free some space (or fix the permissions), then resume with --resume-from-step latest")

    def _wait(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 -- Orbax re-raises what its background save thread met
            raise self._save_failed(e, self._saving) from e
        self._saving = None

    def wait(self) -> None:
        """Blocks until every save started so far is complete on disk (SaveFailedError if one failed)."""
        self._wait()

    def close(self) -> None:
        """Waits for the saves in flight, then releases the directory's lock. A directory this start made and
        saved nothing into is removed (a start that failed leaves no run behind)."""
        try:
            self._wait()
        finally:
            self._manager.close()
            if self._lock is not None:
                self._lock.close()
                self._lock = None
            if self._created and not self._saved and jax.process_index() == 0:
                rundir.remove_if_unused(self.directory)
            self._created = False

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listing --

    def all_steps(self) -> list[int]:
        """Every step directory, complete or damaged (see latest_step for the newest usable one), as process 0
        sees them."""
        self._wait()  # Orbax's save waits for the previous one anyway
        self._manager.reload()  # see steps removed or damaged on disk since
        return decided_by_process_0("steps", lambda: rundir.step_numbers(self.directory))

    def latest_step(self) -> int | None:
        """The newest step whose items and metadata are all present and readable, or None."""
        self._wait()
        return decided_by_process_0("latest step", lambda: rundir.newest_complete_step(self.directory), SHARED_ERRORS)

    def newest_committed_step(self) -> int | None:
        """The newest step directory on disk now, as this process sees it, without waiting for the save in
        flight (which may never end: a lost peer process) or reading it: for messages only."""
        return max(rundir.step_numbers(self.directory), default=None)

    def read_meta(self, step: int) -> dict:
        """The metadata of a complete step (process 0's reading); IncompleteCheckpointError if it is damaged."""
        self._wait()

        def read() -> dict:
            problem = step_problem(self.directory, step)
            if problem:
                raise IncompleteCheckpointError(f"checkpoint step {step} in {self.directory} is incomplete: {problem}")
            return read_step_meta(self.directory, step)

        return decided_by_process_0("meta", read, SHARED_ERRORS)

    # -- restoring --

    def restore(self, step: int | str, abstract_params, abstract_opt_state=None, param_shardings=None, opt_shardings=None,
                data_iter=None, *, model_config: GPTConfig | dict | None = None, tokenizer=None,
                check_meta: Callable[[dict], None] | None = None) -> tuple:
        """Restores (params, opt_state, meta) of `step` (a number, or LATEST: the newest step that
        restores completely, skipping damaged ones with a message) onto the given shardings, and sets
        data_iter's state. abstract_*: ShapeDtypeStruct pytrees of this run's state (jax.eval_shape);
        shardings: matching pytrees of NamedSharding (None: taken from the abstract leaves).
        abstract_opt_state=None restores the parameters only. With model_config/tokenizer, a checkpoint
        of another model or vocabulary is refused (CheckpointMismatchError); so is a step check_meta(meta) refuses
        (raising a CheckpointError), before its arrays are read. A step found damaged is moved into damaged/ at
        once (unless read_only: then it stays), so that no later start can take it for a complete one;
        IncompleteCheckpointError for a numbered step. A read that fails for a reason that is not the step's
        raises StepUnreadableError, and one of the data loader (a shard it re-reads) DataError: nothing is
        skipped or moved."""
        self.wait()
        self._manager.reload()
        targets = {"params": _abstract_with_shardings(abstract_params, param_shardings)}
        if abstract_opt_state is not None:
            targets["opt_state"] = _abstract_with_shardings(abstract_opt_state, opt_shardings)
        skipped = []
        for candidate in decided_by_process_0("restore candidates", lambda: rundir.restore_candidates(self.directory, step),
                                              SHARED_ERRORS):
            try:
                restored = self._restore_step(candidate, targets, data_iter, model_config, tokenizer, check_meta)
            except IncompleteCheckpointError as e:
                kept = self._keep_damaged(candidate)
                if step != LATEST:
                    raise IncompleteCheckpointError(f"{e}; {kept}") from e
                print0(f"Skipping damaged {e}; {kept}")
                skipped.append(candidate)
                continue
            if skipped:
                print0(f"Resuming from step {candidate}, the newest complete checkpoint (skipped {skipped})")
            return restored["params"], restored.get("opt_state"), restored["meta"]
        kept = "kept there, not deleted" if self._read_only else \
            f"moved to {storage.join(self.directory, rundir.DAMAGED_SUBDIR)}, which jaxchat never deletes"
        raise NoCheckpointError(f"No complete checkpoint in {self.directory}: every step ({skipped}) is damaged "
                                f"({kept}); to train anew, pick another --model-tag, or start a new run here (without "
                                "--resume-from-step)")

    def _keep_damaged(self, step: int) -> str:
        """A training run moves a step it found damaged into damaged/ at once: the judgment (which may have needed
        its arrays read) then outlives this process, and no --overwrite start sets the step aside as complete
        and deletes it. A reader (read_only) leaves it. Returns what was done, for the message."""
        if self._read_only:
            return "kept there, not deleted"
        moved, = decided_by_process_0(
            "move damaged", lambda: rundir.move_steps(self.directory, [step], rundir.DAMAGED_SUBDIR), SHARED_ERRORS)
        self._manager.reload()
        return f"moved to {moved}, which jaxchat never deletes"

    def _checked_meta(self, step: int, targets: dict, data_iter, model_config, tokenizer, check_meta) -> dict:
        """Process 0's check of a step before every process reads its arrays: complete, of this model and
        tokenizer, with the items asked for, accepted by check_meta, in this structure. Its metadata, or the
        CheckpointError."""
        where = f"checkpoint step {step} in {self.directory}"
        problem = step_problem(self.directory, step)
        if problem:
            raise IncompleteCheckpointError(f"{where}: {problem}")
        meta = read_step_meta(self.directory, step)
        check_compatible(meta, model_config, tokenizer, where)
        for item in targets:
            if item not in meta["items"]:
                source = f" (imported from {meta['imported_from']})" if "imported_from" in meta else ""
                raise CheckpointMismatchError(
                    f"{where} holds no {item}{source}: it can be evaluated or sampled (load_model), not resumed")
        if data_iter is not None and "data" not in meta["items"]:
            raise CheckpointMismatchError(f"{where} holds no data iterator state to resume the data from")
        if check_meta is not None:  # the caller's own, once the step holds what a resume reads
            check_meta(meta)
        for item, target in targets.items():
            saved, wanted = _signature(saved_structure(self.directory, step, item)), _signature(target)
            if saved != wanted:
                raise CheckpointMismatchError(
                    f"the {item} of {where} has another structure than this run's:\n  "
                    f"{_describe_differences(saved, wanted)}\n"
                    "The code of the model or optimizer changed since it was saved; resume with the version that saved it."
                )
        return meta

    def _restore_step(self, step: int, targets: dict, data_iter, model_config, tokenizer, check_meta) -> dict:
        """The arrays of a step (Orbax), then the data iterator's position: the step's files are judged for damage,
        the data loader's re-reading of shards apart (DataError, never damage)."""
        meta = decided_by_process_0("checked step", lambda: self._checked_meta(step, targets, data_iter, model_config,
                                                                              tokenizer, check_meta), SHARED_ERRORS)
        # strict=False lets Orbax pad (with zeros) or crop Muon's stacks to this run's padding; every other
        # shape was checked equal above
        args = ocp.args.Composite(**{item: ocp.args.StandardRestore(target, strict=item != "opt_state")
                                     for item, target in targets.items()})
        step_dir = storage.join(self.directory, str(step))

        def restore_arrays():
            with reading_step_files(step_dir):  # Orbax reads nothing but the step's files here
                return self._manager.restore(step, args=args)

        # each process's own file first, agreed before Orbax's restore, which ends in a barrier of all processes
        data_state = self._agree_on_outcome(step, "the data state",
                                            lambda: None if data_iter is None else self._read_data_state(step))
        restored = self._agree_on_outcome(step, "the arrays", restore_arrays)
        if data_iter is not None:
            self._agree_on_outcome(step, "the data position", lambda: _set_data_position(step, data_iter, data_state))
        return {"params": restored["params"], "opt_state": restored.get("opt_state"), "meta": meta}

    def _agree_on_outcome(self, step: int, what: str, action):
        """action() on every process (reading `what` of the step), then every process learns every process's
        outcome, so that all skip, stop or go on together: the first failure is raised on all (damage as
        IncompleteCheckpointError, the data's as DataError).
        (A failure inside Orbax's restore on some processes only leaves the others at its closing barrier:
        where the arrays of one step are damaged for some processes only, the run waits there.)"""
        result, outcome = None, None
        try:
            result = action()
        except CheckpointError as e:
            outcome = {"error": type(e).__name__, "message": str(e)}
        except DataError as e:  # the data's, whatever its class: raised as DataError on every process
            outcome = {"error": DataError.__name__, "message": str(e)}
        except Exception as e:  # noqa: BLE001 -- tensorstore's errors arrive wrapped in a bare Exception from Orbax
            outcome = {"damaged": is_damage(e, storage.join(self.directory, str(step))), "reason": error_reason(e)}
        for process, theirs in enumerate(gathered(f"{what} outcome", outcome)):
            if theirs is not None:
                raise self._restore_failure(step, what, process, theirs)
        return result

    def _restore_failure(self, step: int, what: str, process: int, outcome: dict) -> CheckpointError | DataError:
        if "error" in outcome:
            error_class = {cls.__name__: cls for cls in (CheckpointMismatchError, IncompleteCheckpointError, DataError)}
            return error_class.get(outcome["error"], CheckpointError)(outcome["message"])
        by = f" by process {process}" if jax.process_count() > 1 else ""
        if outcome["damaged"]:
            return IncompleteCheckpointError(f"checkpoint step {step} in {self.directory}: {what} cannot be "
                                             f"read{by} ({outcome['reason']})")
        return unreadable(self.directory, step, what, f"{outcome['reason']}{by}")

    def _read_data_state(self, step: int) -> dict:
        """This process's data iterator state: grain writes `process_<i>-of-<n>.json` per process (its
        CheckpointHandler); the file is the step's, so its damage is."""
        data_dir = storage.join(self.directory, str(step), "data")
        count = jax.process_count()
        path = storage.join(data_dir, f"process_{jax.process_index()}-of-{count}.json")
        if storage.exists(path):
            with storage.open_file(path, encoding="utf-8") as f, reading_step_files(path):
                return json.load(f)
        names = storage.listdir(data_dir) if storage.isdir(data_dir) else []
        counts = {m.group(1) for m in (re.match(r"process_\d+-of-(\d+)\.json$", n) for n in names) if m}
        if counts:
            raise CheckpointMismatchError(
                f"the data iterator state of step {step} was saved by {', '.join(sorted(counts))} process(es), this run "
                f"has {count}: resume with the same number of processes (each reads its own share of the data)"
            )
        raise IncompleteCheckpointError(f"checkpoint step {step} in {self.directory} is incomplete: its data state is missing")


def _set_data_position(step: int, data_iter, state: dict) -> None:
    """Sets the data iterator to its saved state, as grain's CheckpointHandler.restore does. The loader re-reads
    the documents that state names from the shards: whatever fails there is not the checkpoint's (DataError)."""
    try:
        data_iter.set_state(state)
        data_iter.start_prefetch()
    except Exception as e:  # noqa: BLE001 -- a shard, the tokenizer, memory: none of it is the step's
        reason = str(e) if isinstance(e, DataError) else f"the data loader failed: {error_reason(e)}"
        raise DataError(f"{reason} (while resuming the data of checkpoint step {step}: the step is not damaged, and "
                        "nothing was skipped or moved; once the data is fixed, the same command resumes it)") from e
