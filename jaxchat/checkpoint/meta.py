"""Checkpoint names, metadata and errors in one place: where a run's checkpoints live (nanochat's layout of
a base dir), nanochat's file names, what a training checkpoint's metadata holds, --resume-from-step's values,
and what can go wrong with checkpoints. jaxchat.checkpoint.manager (Orbax), jaxchat.checkpoint.run_directory, jaxchat.export.nanochat
(nanochat's files), jaxchat.train.settings and scripts.export read them here (the settings without importing Orbax
or grain).

    <base_dir>/base_checkpoints/<model_tag or d<depth>>/        jaxchat: one Orbax step directory per step
    <nanochat_dir>/base_checkpoints/<model_tag>/model_<step:06d>.pt, meta_<step:06d>.json    nanochat
"""

import argparse
import dataclasses
import hashlib
import json
import re

from jaxchat import storage
from jaxchat.model.gpt import DEFAULT_RECIPE, GPTConfig

# Which train flag sets each model_config field, for messages about a mismatch.
CONFIG_FLAGS = {"recipe": "--recipe", "n_layer": "--depth", "n_embd": "--depth and --aspect-ratio",
                "n_head": "--head-dim", "n_kv_head": "--head-dim", "sequence_len": "--max-seq-len", "window_pattern": "--window-pattern",
                "vocab_size": "the tokenizer"}

CHECKPOINTS_SUBDIR = "base_checkpoints"  # under a base dir, jaxchat's and nanochat's alike
# nanochat's checkpoint files (nanochat/checkpoint_manager.py at bdcc030): the weights (.pt; jaxchat's export
# also writes .safetensors) and the metadata of one step
NANOCHAT_WEIGHTS_FILE = re.compile(r"model_(\d+)\.(pt|safetensors)$")


class CheckpointError(Exception):
    """Anything a user must fix about checkpoints; the message says what and how."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint is complete but belongs to another model, tokenizer, number of processes or run (settings
    that change the maths, jaxchat.train.settings.resume_difference), or its meta lacks what a resume needs."""


class IncompleteCheckpointError(CheckpointError, ValueError):
    """A step's files are provably incomplete or corrupt (missing, cut short, undecodable): it is damaged."""


class StepUnreadableError(CheckpointError):
    """Reading a step failed for a reason that is not the step's (out of memory, an I/O error, a permission):
    the run stops, and nothing is skipped, moved or deleted."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint where one was asked for."""


class SaveFailedError(CheckpointError):
    """Writing a step failed (no space, permission lost): the previous complete step is still the newest."""


LATEST = "latest"  # --resume-from-step latest, restore(step=LATEST): the newest complete checkpoint


def parse_resume_step(text: str) -> int | str:
    """argparse type for --resume-from-step: a step number, -1 (do not resume) or 'latest'."""
    if text.strip().lower() == LATEST:
        return LATEST
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"--resume-from-step takes a step number, -1 (start fresh) or '{LATEST}', got {text!r}") from None
    if step < -1:
        raise ValueError(f"--resume-from-step {step}: steps are >= 0 (or -1 to start fresh, '{LATEST}' for the newest)")
    return step


def default_model_tag(depth: int) -> str:
    """The run directory's name when --model-tag is not given (as base_train.py)."""
    return f"d{depth}"


# A model tag names one directory under base_checkpoints/ (and the report's curve, the profiles, the eval CSVs):
# one path component of safe characters, so that no tag ('../x', '/abs', 'a/b') writes outside those folders.
MODEL_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_model_tag(tag: str) -> str:
    """`tag` if it is a valid model tag, else ValueError saying what one is."""
    if not isinstance(tag, str) or not MODEL_TAG.fullmatch(tag):
        raise ValueError(f"model tag {tag!r} is not one directory name: use letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit, at most 128 characters (e.g. d20, d20-long_run.2)")
    return tag


def model_tag_flag(text: str) -> str:
    """argparse type of every script's --model-tag: check_model_tag, as argparse's one-line error."""
    try:
        return check_model_tag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def nanochat_files(step: int, weights_ext: str = "pt") -> tuple[str, str]:
    """(weights file, metadata file) of one step, as nanochat names them."""
    return f"model_{step:06d}.{weights_ext}", f"meta_{step:06d}.json"


@dataclasses.dataclass(frozen=True)
class TrainingMeta:
    """What a training checkpoint records besides its arrays: nanochat's meta_<step>.json fields (but its
    dataloader_state_dict: jaxchat saves the data iterator as an item of its own) and the tokenizer's
    identity. JSON: `dataclasses.asdict`."""

    step: int
    val_bpb: float | None  # the last validation bpb
    model_config: dict  # GPTConfig's fields
    user_config: dict  # the run's command-line settings (RunSettings.user_config), its recipe among them
    device_batch_size: int
    max_seq_len: int
    loop_state: dict  # LoopState's other fields: min_val_bpb, smooth_train_loss, total_training_time
    tokenizer: dict  # {vocab_size, sha256}: a retrained tokenizer of the same size is told apart
    # What the settings resolved to (jaxchat.train.run.Run.resolved), which a resumed run must resolve to as well; absent
    # from checkpoints saved before they were recorded, which resume all the same (so a save does not require them)
    total_batch_size: int | None = None  # tokens per step (nanochat 92d63d4's meta has it too)
    num_iterations: int | None = None  # the horizon
    compute_dtype: str | None = None


# What a training checkpoint's metadata must hold for an exact resume (the step is the checkpoint's own)
TRAINING_META_KEYS = tuple(f.name for f in dataclasses.fields(TrainingMeta)
                           if f.name != "step" and f.default is dataclasses.MISSING)


# ---- what a checkpoint records, and whether it is this run's -------------------------------------

def step_meta_file(directory: str, step: int) -> str:
    """The JSON file of a step's metadata: its item "meta", as Orbax's JsonCheckpointHandler writes it."""
    return storage.join(directory, str(step), "meta", "metadata")


def tokenizer_info(tokenizer) -> dict:
    """What a checkpoint records of its tokenizer: the vocabulary size and a hash of the vocabulary
    itself (merges in rank order, split pattern, special tokens), so a retrained tokenizer of the
    same size is told apart."""
    digest = hashlib.sha256(tokenizer.pattern.encode())
    for token in sorted(tokenizer.mergeable_ranks, key=tokenizer.mergeable_ranks.get):
        digest.update(len(token).to_bytes(2, "little") + token)
    digest.update(json.dumps(tokenizer.special_tokens, sort_keys=True).encode())
    return {"vocab_size": tokenizer.get_vocab_size(), "sha256": digest.hexdigest()}


def training_meta(loop_meta: dict, run, tokenizer) -> dict:
    """A training checkpoint's metadata (a TrainingMeta, as JSON): the loop's state (LoopState.to_meta), and of
    the run (a jaxchat.train.run.Run) its model config, its settings (the command line as user_config, its recipe
    among them) and what they resolved to, and the tokenizer's identity."""
    settings = run.settings
    return dataclasses.asdict(TrainingMeta(
        **loop_meta, model_config=dataclasses.asdict(run.config), user_config=settings.user_config(),
        device_batch_size=settings.device_batch_size, max_seq_len=settings.max_seq_len,
        tokenizer=tokenizer_info(tokenizer), **run.resolved()))


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
