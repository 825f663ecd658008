"""A saved model for the scripts that evaluate or sample one (scripts.base_eval, base_loss, sample): their
shared flags, and JAX started as they say with the checkpoint's model and tokenizer loaded."""

import argparse
import os

from jaxchat.checkpoint import CheckpointError
from jaxchat.common import PlatformError

# What loading can fail with, each message saying what to do: a script prints it and exits
LOAD_ERRORS: tuple[type[Exception], ...] = (FileNotFoundError, PlatformError, CheckpointError)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-tag", type=str, default=None,
                        help="checkpoint directory under <base_dir>/base_checkpoints (default: the deepest d<N>)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu (empty = autodetect)")


def load_saved_model(args: argparse.Namespace):
    """Start JAX as the flags say and load (model, tokenizer, meta, model_tag). Raises one of LOAD_ERRORS."""
    from jaxchat.common import quiet_jax_warnings, select_platform
    from jaxchat.mesh import maybe_initialize_distributed

    quiet_jax_warnings()  # first, so that starting the backend prints nothing of the libraries' either
    maybe_initialize_distributed()  # before anything touches a device
    select_platform(args.device_type)

    from jaxchat.checkpoint import find_model_tag, load_model
    from jaxchat.checkpoint_meta import CHECKPOINTS_SUBDIR
    from jaxchat.common import get_base_dir
    from jaxchat.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    model_tag = args.model_tag or find_model_tag(os.path.join(get_base_dir(), CHECKPOINTS_SUBDIR))
    model, meta = load_model(model_tag, args.step, tokenizer=tokenizer)
    return model, tokenizer, meta, model_tag
