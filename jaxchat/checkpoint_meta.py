"""Checkpoint names and metadata in one place: where a run's checkpoints live (nanochat's layout of a
base dir), nanochat's file names, what a training checkpoint's metadata holds, and --resume-from-step's
values. jaxchat.checkpoint (Orbax), jaxchat.interop (nanochat's files), jaxchat.settings and scripts.export
read them here (the settings without importing Orbax or grain).

    <base_dir>/base_checkpoints/<model_tag or d<depth>>/        jaxchat: one Orbax step directory per step
    <nanochat_dir>/base_checkpoints/<model_tag>/model_<step:06d>.pt, meta_<step:06d>.json    nanochat
"""

import dataclasses
import re

CHECKPOINTS_SUBDIR = "base_checkpoints"  # under a base dir, jaxchat's and nanochat's alike
TOKENIZER_SUBDIR = "tokenizer"  # under a base dir, jaxchat's and nanochat's alike
# nanochat's checkpoint files (nanochat/checkpoint_manager.py at bdcc030): the weights (.pt; jaxchat's export
# also writes .safetensors) and the metadata of one step
NANOCHAT_WEIGHTS_FILE = re.compile(r"model_(\d+)\.(pt|safetensors)$")


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


# What a training checkpoint's metadata must hold for an exact resume (the step is the checkpoint's own)
TRAINING_META_KEYS = tuple(f.name for f in dataclasses.fields(TrainingMeta) if f.name != "step")
