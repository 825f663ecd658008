"""Checkpoints of a training run with Orbax: exact resume, on any mesh, safe against interruption.

One directory per run, `<base_dir>/base_checkpoints/<model_tag or d{depth}>/`, one Orbax step
directory per saved step holding
  params     the model parameters (an nnx.State of arrays)
  opt_state  the optimizer state (an optax pytree; it holds the step counts, so schedules resume)
  data       the train data iterator's state, one JSON file per process (grain's Orbax handler)
  meta       JSON: step, val_bpb, model_config, user_config, device_batch_size, max_seq_len,
             loop_state {min_val_bpb, smooth_train_loss, total_training_time}, tokenizer
             {vocab_size, sha256}, and the list of items saved

Saving is asynchronous: `save` returns once the arrays are copied off the devices (so the train
step may donate them) and the data iterator's state is written; Orbax writes the rest from a
background thread while training goes on. `wait` blocks until it is on disk; `close` waits too.

One writer per run directory: a RunCheckpoints that writes holds the directory's lock (jaxchat.run_lock,
taken by process 0) from its start to close(), so a second run on the same directory stops at once,
and the start-up removal of unfinished saves never touches a live run's.

Orbax writes a step into `<step>.orbax-checkpoint-tmp-<time>` and renames it when complete, so an
interrupted or failed save (a full disk) never looks like a step: the previous one stays the newest.
A step damaged afterwards (files deleted or truncated) is caught when its items, metadata or arrays
cannot be read: resuming from "latest" then takes the newest step that restores completely and says
which it skipped. A damaged step is never deleted: when a resumed run reaches its number again it
is moved into `damaged/`, where it can still be looked at.

A new run where checkpoints exist is refused (start_fresh) unless told to overwrite them; then they
are moved into `replaced/` and deleted only once the new run's first checkpoint is complete.

Restoring takes target shardings: a run saved on 8 devices resumes on 1, 2 or 4, replicated or
FSDP, with the same values (Orbax reads each target shard from the saved chunks).
"""

import dataclasses
import hashlib
import json
import os
import re
import shutil

import grain.checkpoint
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxchat.checkpoint_meta import CHECKPOINTS_SUBDIR, LATEST, TRAINING_META_KEYS, TrainingMeta, default_model_tag
from jaxchat.common import base_dir_hint, get_base_dir, key_name, print0
from jaxchat.gpt import DEFAULT_RECIPE, GPT, GPTConfig, abstract_model
from jaxchat.interop import read_nanochat_meta
from jaxchat.mesh import make_mesh, replicated
from jaxchat.run_lock import RunLock, RunLockedError, acquire_run_lock

# TRAINING_META_KEYS: checked when saving, so a wiring mistake shows at the first save rather than at the resume
# Which train flag sets each model_config field, for messages about a mismatch.
CONFIG_FLAGS = {"recipe": "--recipe", "n_layer": "--depth", "n_embd": "--depth and --aspect-ratio",
                "n_head": "--head-dim", "n_kv_head": "--head-dim", "sequence_len": "--max-seq-len", "window_pattern": "--window-pattern",
                "vocab_size": "the tokenizer"}
_TMP_STEP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")
# Folders of a run directory beside its steps (names that are not step numbers: Orbax ignores them).
REPLACED_SUBDIR = "replaced"  # an earlier run's steps, until an --overwrite run's first checkpoint is complete
DAMAGED_SUBDIR = "damaged"  # damaged steps a resumed run has saved over (kept as evidence, never deleted)


class CheckpointError(Exception):
    """Anything a user must fix about checkpoints; the message says what and how."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is complete but belongs to another model, tokenizer or number of processes."""


class IncompleteCheckpointError(CheckpointError, ValueError):
    """A step is missing items or cannot be read (an interrupted or damaged save)."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for."""


class SaveFailedError(CheckpointError):
    """Writing a step failed (no space, permission lost): the previous complete step is still the newest."""


# ---- paths, flags and checks before training ----------------------------------------------------

def checkpoint_dir(model_tag: str | None, depth: int, base_dir: str | None = None) -> str:
    """`<base_dir>/base_checkpoints/<model_tag or d{depth}>`, as nanochat."""
    return os.path.join(base_dir or get_base_dir(), CHECKPOINTS_SUBDIR, model_tag or default_model_tag(depth))


def check_writable(directory: str, bytes_needed: int = 0) -> None:
    """Fails now, with what to do, if checkpoints could not be written to `directory` later."""
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, f".write_test_{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"Cannot write checkpoints to {directory} ({e.strerror or e}). Point $JAXCHAT_BASE_DIR at a "
            "writable directory, or fix the permissions, before training."
        ) from e
    free = shutil.disk_usage(directory).free
    if bytes_needed > free:
        raise CheckpointError(
            f"A checkpoint needs about {bytes_needed / 1e9:.2f} GB but only {free / 1e9:.2f} GB are free under "
            f"{directory}. Free some space, keep fewer checkpoints, or set $JAXCHAT_BASE_DIR elsewhere."
        )


def tokenizer_info(tokenizer) -> dict:
    """What a checkpoint records of its tokenizer: the vocabulary size and a hash of the vocabulary
    itself (merges in rank order, split pattern, special tokens), so a retrained tokenizer of the
    same size is told apart."""
    digest = hashlib.sha256(tokenizer.pattern.encode())
    for token in sorted(tokenizer.mergeable_ranks, key=tokenizer.mergeable_ranks.get):
        digest.update(len(token).to_bytes(2, "little") + token)
    digest.update(json.dumps(tokenizer.special_tokens, sort_keys=True).encode())
    return {"vocab_size": tokenizer.get_vocab_size(), "sha256": digest.hexdigest()}


def training_meta(loop_meta: dict, model_config: GPTConfig, settings, tokenizer) -> dict:
    """A training checkpoint's metadata (a TrainingMeta, as JSON): the loop's state (LoopState.to_meta),
    the model config, the run's settings (a jaxchat.settings.RunSettings: its command line as user_config,
    its recipe among them) and the tokenizer's identity."""
    return dataclasses.asdict(TrainingMeta(
        **loop_meta, model_config=dataclasses.asdict(model_config), user_config=settings.user_config(),
        device_batch_size=settings.device_batch_size, max_seq_len=settings.max_seq_len,
        tokenizer=tokenizer_info(tokenizer)))


def config_differences(saved: dict, model_config: GPTConfig | dict) -> list[str]:
    """Each model_config field where a checkpoint's differs from this run's, with the flag that sets it."""
    wanted = model_config if isinstance(model_config, dict) else dataclasses.asdict(model_config)
    # a model_config without a recipe is from before recipes: the default one
    saved, wanted = ({**config, "recipe": config.get("recipe", DEFAULT_RECIPE)} for config in (saved, wanted))
    return [f"{key}: checkpoint {saved.get(key)!r}, this run {wanted.get(key)!r} (set by {CONFIG_FLAGS.get(key, key)})"
            for key in sorted(set(saved) | set(wanted)) if saved.get(key) != wanted.get(key)]


def check_compatible(meta: dict, model_config: GPTConfig | dict | None = None, tokenizer=None,
                     where: str = "the checkpoint") -> None:
    """Raises CheckpointMismatchError, naming every difference and what to do, if the checkpoint's
    model config differs from this run's or its vocabulary from the tokenizer on disk."""
    saved = meta["model_config"]
    problems = []
    if model_config is not None:
        wanted = model_config if isinstance(model_config, dict) else dataclasses.asdict(model_config)
        # (no recipe: from before recipes, the default one) another recipe is another model: one message for it
        saved_recipe, wanted_recipe = (config.get("recipe", DEFAULT_RECIPE) for config in (saved, wanted))
        if saved_recipe != wanted_recipe:
            raise CheckpointMismatchError(
                f"{where} holds a --recipe {saved_recipe} model, this run builds --recipe {wanted_recipe}: pass "
                f"--recipe {saved_recipe} to continue or load it, or start a new run under another --model-tag")
        problems = config_differences(saved, wanted)
    if tokenizer is not None:
        vocab_size = tokenizer.get_vocab_size()
        recorded = meta.get("tokenizer") or {}
        if saved["vocab_size"] != vocab_size:
            problems.append(f"tokenizer: the checkpoint was trained with a vocabulary of {saved['vocab_size']} tokens, "
                            f"the tokenizer on disk has {vocab_size}")
        elif recorded.get("sha256") and recorded["sha256"] != tokenizer_info(tokenizer)["sha256"]:
            problems.append(f"tokenizer: same size ({vocab_size}) but a different vocabulary than the one the "
                            "checkpoint was trained with (the tokenizer was retrained since)")
    if problems:
        raise CheckpointMismatchError(
            f"{where} does not match this run:\n  " + "\n  ".join(problems) + "\n"
            "To continue that run, use the flags it was started with (its meta 'user_config' lists them) and its "
            "tokenizer; to start a new run, drop --resume-from-step or choose another --model-tag."
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
    The length of Muon's stacks is left out: it is padded to a multiple of the device count (jaxchat.optim
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


def error_reason(error: BaseException) -> str:
    """One line for an error: its innermost cause (Orbax wraps tensorstore's ValueError, which says what
    is wrong with which file, in a bare Exception whose message is a page of TensorStore spec)."""
    while error.__cause__ is not None or (error.__context__ is not None and not error.__suppress_context__):
        error = error.__cause__ or error.__context__
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 300:  # tensorstore puts the path first and the reason ("No space left on device") last
        text = text[:140] + " ... " + text[-150:]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _sync(name: str) -> None:
    """All processes wait here (after process 0 changed the run directory)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _lock_run_directory(directory: str) -> RunLock | None:
    """Process 0 takes the run directory's lock; every process learns whether it got it, so that all stop
    together (rather than the others waiting at Orbax's first barrier). Raises CheckpointError if refused."""
    lock, refusal = None, None
    if jax.process_index() == 0:
        try:
            lock = acquire_run_lock(directory)
        except RunLockedError as e:
            refusal = str(e)
    if jax.process_count() > 1:
        refused = bool(multihost_utils.broadcast_one_to_all(np.int32(refusal is not None)))
        if refused and refusal is None:
            refusal = f"{directory} is in use by another run (process 0's message names it)"
    if refusal:
        raise CheckpointError(refusal)
    return lock


def _unused_path(path: str) -> str:
    """path, or path-2, path-3, ... whichever does not exist yet."""
    candidate, n = path, 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{path}-{n}"
    return candidate


# ---- the checkpoint manager ---------------------------------------------------------------------

class RunCheckpoints:
    """The checkpoints of one run in `directory`: one Orbax CheckpointManager saving the state (params,
    optimizer state), the data iterator's position and the metadata of a step together, as nanodo does;
    one check (the step complete, the model, tokenizer, structure and process count compatible) before
    any restore.

        ckpt = RunCheckpoints(directory, max_to_keep=3)
        ckpt.save(step, params, opt_state, train_iter, meta)           # returns while Orbax writes
        params, opt_state, meta = ckpt.restore("latest", abstract_params, abstract_opt_state,
                                               param_shardings, opt_shardings, data_iter=train_iter,
                                               model_config=config, tokenizer=tokenizer)
        ckpt.close()

    Every process calls every method (Orbax coordinates the writes); messages print on process 0.
    Unless read_only, it holds the directory's lock until close(): CheckpointError at once if another
    process holds it.
    """

    def __init__(self, directory: str, max_to_keep: int | None = None, async_save: bool = True,
                 read_only: bool = False):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be at least 1 (or None to keep every step), got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise _no_checkpoints(self.directory)
        # before anything in the directory is removed (Orbax's start-up cleaning below)
        self._lock = None if read_only else _lock_run_directory(self.directory)
        self._damaged: set[int] = set()  # steps restore found unreadable
        self._replaced_dir: str | None = None  # set aside by start_fresh(overwrite=True), until the first save
        self._saving: int | None = None  # the step of the save in flight
        unfinished = sorted(name for name in os.listdir(self.directory) if _TMP_STEP.match(name)) \
            if os.path.isdir(self.directory) else []
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

    # -- saving --

    def save(self, step: int, params, opt_state, data_iter, meta: dict) -> None:
        """Saves `step` asynchronously. opt_state or data_iter may be None for a weights-only step
        (an imported model); a training checkpoint needs every key of TRAINING_META_KEYS in meta.
        The data iterator's state is taken now, so save before drawing the next batch.
        Steps >= `step` already on disk (from a run this one resumed before they were written) are
        replaced: their states would no longer follow from this run's; a damaged one is moved into
        damaged/ instead. SaveFailedError if writing fails (here or, for the step before, in Orbax's
        background thread)."""
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
        self._saving = step
        if self._replaced_dir is not None:
            self._delete_replaced(step)

    def _clear_steps_from(self, step: int) -> None:
        """Makes room for `step`: newer steps of an abandoned future are deleted, damaged ones moved aside."""
        newer = [s for s in self.all_steps() if s >= step]
        damaged = [s for s in newer if s in self._damaged or self._problem(s) is not None]
        for s in damaged:
            target = _unused_path(os.path.join(self.directory, DAMAGED_SUBDIR, str(s)))
            if jax.process_index() == 0:
                os.makedirs(os.path.dirname(target), exist_ok=True)
                os.rename(os.path.join(self.directory, str(s)), target)
            print0(f"Moved damaged checkpoint step {s} to {target} to save this run's step {step} (kept, not deleted)")
        if damaged:
            _sync("jaxchat_checkpoint_moved_damaged")
        replaced = [s for s in newer if s not in damaged]
        if replaced:
            print0(f"Replacing checkpoint step(s) {replaced} in {self.directory} by this run's step {step}")
            for s in replaced:
                self._manager.delete(s)
        self._manager.reload()

    def _delete_replaced(self, step: int) -> None:
        """The first save of a run started with overwrite: once it is complete, the old steps go."""
        self._wait()
        if self._problem(step) is not None:
            return  # not readable back: keep the old steps, try again at the next save
        if jax.process_index() == 0:
            shutil.rmtree(self._replaced_dir)
        _sync("jaxchat_checkpoint_deleted_replaced")
        print0(f"Deleted the replaced checkpoints in {self._replaced_dir}: this run's step {step} is complete")
        self._replaced_dir = None

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
        """Waits for the saves in flight, then releases the directory's lock."""
        try:
            self._wait()
        finally:
            self._manager.close()
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    def __enter__(self) -> "RunCheckpoints":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- a new run where checkpoints exist --

    def start_fresh(self, overwrite: bool = False) -> None:
        """For a run that does not resume, before it writes anything: CheckpointError where checkpoints
        exist, unless overwrite. Then they are moved into replaced/ and deleted once this run's first
        checkpoint is complete (a run that fails before that costs nothing)."""
        steps = self.all_steps()
        replaced_dir = os.path.join(self.directory, REPLACED_SUBDIR)
        set_aside = os.path.isdir(replaced_dir) and bool(os.listdir(replaced_dir))
        if not overwrite:
            if steps:
                raise CheckpointError(
                    f"{self.directory} holds the checkpoints of an earlier run (steps {steps}): resume it with "
                    "--resume-from-step latest, pick another --model-tag, or pass --overwrite to replace them "
                    "(they are deleted once this run's first checkpoint is complete)")
            if set_aside:
                raise CheckpointError(
                    f"{replaced_dir} holds the checkpoints of a run that an --overwrite run replaced before saving "
                    f"any: pass --overwrite to replace them, or move them back into {self.directory} to resume them")
            return
        if jax.process_index() == 0 and steps:
            os.makedirs(replaced_dir, exist_ok=True)
            for s in steps:
                os.rename(os.path.join(self.directory, str(s)), _unused_path(os.path.join(replaced_dir, str(s))))
        _sync("jaxchat_checkpoint_set_aside")
        self._manager.reload()
        if steps or set_aside:
            print0(f"--overwrite: the earlier run's checkpoints are moved to {replaced_dir}, and deleted once this "
                   "run's first checkpoint is complete")
            self._replaced_dir = replaced_dir

    # -- listing --

    def all_steps(self) -> list[int]:
        """Every step directory, complete or not (see latest_step for the newest usable one)."""
        self._wait()  # Orbax's save waits for the previous one anyway
        self._manager.reload()  # see steps removed or damaged on disk since
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step whose items and metadata are all present and readable, or None."""
        for step in reversed(self.all_steps()):
            if self._problem(step) is None:
                return step
        return None

    def newest_committed_step(self) -> int | None:
        """The newest step directory on disk now, without waiting for the save in flight (which may never
        end: a lost peer process) or reading it: Orbax gives a step its name only once it is complete."""
        steps = [int(name) for name in os.listdir(self.directory) if name.isdigit()]
        return max(steps, default=None)

    def read_meta(self, step: int) -> dict:
        self.wait()
        problem = self._problem(step)
        if problem:
            raise IncompleteCheckpointError(f"checkpoint step {step} in {self.directory} is incomplete: {problem}")
        return self._read_meta(step)

    def _read_meta(self, step: int) -> dict:
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def _problem(self, step: int) -> str | None:
        """Why `step` cannot be restored (missing items, unreadable metadata), or None if it looks complete."""
        step_dir = os.path.join(self.directory, str(step))
        if not os.path.isdir(os.path.join(step_dir, "meta")):
            return "its metadata is missing"
        try:
            meta = self._read_meta(step)
        except Exception as e:  # noqa: BLE001 -- whatever Orbax raises about a damaged file
            return f"its metadata cannot be read ({error_reason(e)})"
        if not isinstance(meta, dict) or meta.get("step") != step or "model_config" not in meta or "items" not in meta:
            return "its metadata is not a jaxchat checkpoint's"
        for item in meta["items"]:
            if not os.path.isdir(os.path.join(step_dir, item)):
                return f"its {item} is missing"
            if item in ("params", "opt_state"):
                try:
                    self._manager.item_metadata(step)[item].tree
                except Exception as e:  # noqa: BLE001 -- whatever Orbax raises about a damaged file
                    return f"its {item} metadata cannot be read ({error_reason(e)})"
        return None

    def _candidates(self, step: int | str) -> list[int]:
        if step == LATEST:
            steps = self.all_steps()
            if not steps:
                raise NoCheckpointError(f"No checkpoints in {self.directory}: nothing to resume from")
            return list(reversed(steps))
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a step number or '{LATEST}', got {step!r}")
        if step not in self.all_steps():
            raise NoCheckpointError(f"No checkpoint step {step} in {self.directory}; steps there: {self.all_steps()}")
        return [step]

    # -- restoring --

    def restore(self, step: int | str, abstract_params, abstract_opt_state=None, param_shardings=None, opt_shardings=None,
                data_iter=None, *, model_config: GPTConfig | dict | None = None, tokenizer=None) -> tuple:
        """Restores (params, opt_state, meta) of `step` (a number, or LATEST: the newest step that
        restores completely, skipping damaged ones with a message) onto the given shardings, and sets
        data_iter's state. abstract_*: ShapeDtypeStruct pytrees of this run's state (jax.eval_shape);
        shardings: matching pytrees of NamedSharding (None: taken from the abstract leaves).
        abstract_opt_state=None restores the parameters only. With model_config/tokenizer, a checkpoint
        of another model or vocabulary is refused (CheckpointMismatchError)."""
        self.wait()
        targets = {"params": _abstract_with_shardings(abstract_params, param_shardings)}
        if abstract_opt_state is not None:
            targets["opt_state"] = _abstract_with_shardings(abstract_opt_state, opt_shardings)
        skipped = []
        for candidate in self._candidates(step):
            try:
                restored = self._restore_step(candidate, targets, data_iter, model_config, tokenizer)
            except IncompleteCheckpointError as e:
                self._damaged.add(candidate)
                if step != LATEST:
                    raise
                print0(f"Skipping damaged {e} (kept there, not deleted)")
                skipped.append(candidate)
                continue
            if skipped:
                print0(f"Resuming from step {candidate}, the newest complete checkpoint (skipped {skipped})")
            return restored["params"], restored.get("opt_state"), restored["meta"]
        raise NoCheckpointError(f"No complete checkpoint in {self.directory}: every step ({skipped}) is damaged "
                                "(kept there, not deleted); to train anew, pick another --model-tag, or pass "
                                "--overwrite instead of --resume-from-step")

    def _restore_step(self, step: int, targets: dict, data_iter, model_config, tokenizer) -> dict:
        where = f"checkpoint step {step} in {self.directory}"
        problem = self._problem(step)
        if problem:
            raise IncompleteCheckpointError(f"{where}: {problem}")
        meta = self._read_meta(step)
        check_compatible(meta, model_config, tokenizer, where)
        for item in targets:
            if item not in meta["items"]:
                source = f" (imported from {meta['imported_from']})" if "imported_from" in meta else ""
                raise CheckpointMismatchError(
                    f"{where} holds no {item}{source}: it can be evaluated or sampled (load_model), not resumed")
        if data_iter is not None and "data" not in meta["items"]:
            raise CheckpointMismatchError(f"{where} holds no data iterator state to resume the data from")
        metadata = self._manager.item_metadata(step)
        for item, target in targets.items():
            saved, wanted = _signature(metadata[item].tree), _signature(target)
            if saved != wanted:
                raise CheckpointMismatchError(
                    f"the {item} of {where} has another structure than this run's:\n  "
                    f"{_describe_differences(saved, wanted)}\n"
                    "The code of the model or optimizer changed since it was saved; resume with the version that saved it."
                )
        # strict=False lets Orbax pad (with zeros) or crop Muon's stacks to this run's padding; every other
        # shape was checked equal above
        args = {item: ocp.args.StandardRestore(target, strict=item != "opt_state") for item, target in targets.items()}
        if data_iter is not None:
            self._check_data_state(step)
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 -- tensorstore's ValueError about a truncated or missing file, in
            # a bare Exception from Orbax; the structure and shapes were checked above, so this is damage
            raise IncompleteCheckpointError(f"{where}: its arrays cannot be read ({error_reason(e)})") from e
        return {"params": restored["params"], "opt_state": restored.get("opt_state"), "meta": meta}

    def _check_data_state(self, step: int) -> None:
        """grain writes `process_<i>-of-<n>.json` per process: this process's file must be there."""
        data_dir = os.path.join(self.directory, str(step), "data")
        count = jax.process_count()
        if os.path.exists(os.path.join(data_dir, f"process_{jax.process_index()}-of-{count}.json")):
            return
        counts = {m.group(1) for m in (re.match(r"process_\d+-of-(\d+)\.json$", n) for n in os.listdir(data_dir)) if m}
        if counts:
            raise CheckpointMismatchError(
                f"the data iterator state of step {step} was saved by {', '.join(sorted(counts))} process(es), this run "
                f"has {count}: resume with the same number of processes (each reads its own share of the data)"
            )
        raise IncompleteCheckpointError(f"checkpoint step {step} in {self.directory} is incomplete: its data state is missing")


# ---- loading a model for evaluation and sampling ------------------------------------------------

def _no_checkpoints(directory: str) -> NoCheckpointError:
    return NoCheckpointError(f"No checkpoints at {directory}{base_dir_hint(directory)}: train a model first "
                             "(python -m scripts.train)")


def find_model_tag(checkpoints_root: str) -> str:
    """The deepest d<N> run under checkpoints_root, else the most recently written one (as nanochat)."""
    if not os.path.isdir(checkpoints_root):
        raise _no_checkpoints(checkpoints_root)
    tags = [t for t in os.listdir(checkpoints_root) if os.path.isdir(os.path.join(checkpoints_root, t))]
    if not tags:
        raise _no_checkpoints(checkpoints_root)
    depths = [(int(m.group(1)), t) for t in tags if (m := re.fullmatch(r"d(\d+)", t))]
    if depths:
        return max(depths)[1]
    return max(tags, key=lambda t: os.path.getmtime(os.path.join(checkpoints_root, t)))


def load_model(model_tag: str | None = None, step: int | None = None, base_dir: str | None = None,
               tokenizer=None, mesh: Mesh | None = None, **model_kwargs) -> tuple[GPT, dict]:
    """The GPT of a checkpoint, built from its metadata alone, parameters replicated over `mesh` (default:
    every device; no optimizer state is read). model_tag None: the deepest d<N> run; step None: the newest
    complete step. With a tokenizer, a vocabulary that differs from the model's is refused. model_kwargs go
    to GPT (dtype, attention_implementation)."""
    root = os.path.join(base_dir or get_base_dir(), CHECKPOINTS_SUBDIR)
    model_tag = model_tag or find_model_tag(root)
    with RunCheckpoints(os.path.join(root, model_tag), read_only=True) as ckpt:
        if step is None:
            step = ckpt.latest_step()
            if step is None:
                raise NoCheckpointError(f"No complete checkpoint in {ckpt.directory}")
        config = GPTConfig(**ckpt.read_meta(step)["model_config"])
        graphdef, abstract_params, rest = nnx.split(abstract_model(config, **model_kwargs), nnx.Param, ...)
        shardings = replicated(abstract_params, mesh or make_mesh())
        params, _, meta = ckpt.restore(step, abstract_params, None, shardings, tokenizer=tokenizer)
    print0(f"Loaded {model_tag} step {step} from {ckpt.directory}")
    return nnx.merge(graphdef, params, rest), meta


# ---- starting a new run from given weights (--init-from) ----------------------------------------

def load_init_params(path: str, model_config: GPTConfig, abstract_params, shardings, tokenizer=None,
                     **model_kwargs):
    """The parameters of `path`, placed on `shardings`, for a new run (--init-from): a jaxchat run directory
    (its newest complete step), one of its step directories, or nanochat weights (model_<step>.pt or
    .safetensors, with meta_<step>.json beside them). Only the weights: optimizer, schedule, data and step
    start anew. CheckpointError, one line, if path is none of these or its model is not this run's.
    model_kwargs: the run's GPT keyword arguments (recipe features), for nanochat's weights."""
    where = f"--init-from {path}"
    if os.path.isfile(path):
        from jaxchat.interop import (config_from_nanochat_meta, from_nanochat_state_dict, load_nanochat_state_dict,
                                     recipe_of_state_dict)

        try:
            saved = config_from_nanochat_meta(read_nanochat_meta(path, None)[0], path)
            state_dict = load_nanochat_state_dict(path)
            # nanochat's meta does not name the recipe: its parameter names do
            saved = dataclasses.replace(saved, recipe=recipe_of_state_dict(saved, state_dict))
            _check_init_config(where, dataclasses.asdict(saved), model_config)
            model = from_nanochat_state_dict(model_config, state_dict, **model_kwargs)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        print0(f"Initialised the weights from nanochat's {path}; optimizer, schedule and data start anew")
        return jax.device_put(nnx.state(model, nnx.Param), shardings)
    if not os.path.isdir(path):
        raise NoCheckpointError(f"{where}: no such file or directory; give a jaxchat run directory, one of its step "
                                "directories, or nanochat's model_<step>.pt")
    name = os.path.basename(os.path.normpath(path))
    run_dir, step = (os.path.dirname(os.path.normpath(path)), int(name)) if name.isdigit() else (path, None)
    try:
        ckpt = RunCheckpoints(run_dir, read_only=True)
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e}") from None
    with ckpt:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise NoCheckpointError(f"{where}: no complete checkpoint there; give a jaxchat run directory "
                                    "(base_checkpoints/<tag>), one of its step directories, or nanochat's model_<step>.pt")
        _check_init_config(where, ckpt.read_meta(step)["model_config"], model_config)
        params, _, _ = ckpt.restore(step, abstract_params, None, shardings, tokenizer=tokenizer)
    print0(f"Initialised the weights from step {step} of {run_dir}; optimizer, schedule and data start anew")
    return params


def _check_init_config(where: str, saved: dict, model_config: GPTConfig) -> None:
    problems = config_differences(saved, model_config)
    if problems:
        raise CheckpointMismatchError(f"{where}: another architecture than this run's ({'; '.join(problems)}): "
                                      "pass the flags and --recipe it was trained with")
