"""A saved model: loaded for the scripts that evaluate, sample or export one (scripts.base_eval, base_loss,
sample, export: their shared flags, JAX started as they say, the checkpoint's model and tokenizer), and the
weights a new run starts from (--init-from)."""

import argparse
import dataclasses
import os

from jaxchat import storage
from jaxchat.checkpoint.meta import (CHECKPOINTS_SUBDIR, CheckpointError, CheckpointMismatchError, NoCheckpointError,
                                     model_tag_flag)
from jaxchat.common import PlatformError
from jaxchat.data.tokenizer import TokenizerError
from jaxchat.distributed.compilation_cache import add_compilation_cache_flag, enable_compilation_cache

# What loading can fail with, each message saying what to do: a script prints it and exits
LOAD_ERRORS: tuple[type[Exception], ...] = (FileNotFoundError, TokenizerError, PlatformError, CheckpointError)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-tag", type=model_tag_flag, default=None,
                        help="checkpoint directory under <base_dir>/base_checkpoints (default: the deepest d<N> "
                             "that holds a model)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--device-type", type=str, default="", help="cuda|cpu (empty = autodetect)")
    add_compilation_cache_flag(parser)


def load_saved_model(args: argparse.Namespace):
    """Start JAX as the flags say and load (model, tokenizer, meta, model_tag). Raises one of LOAD_ERRORS."""
    from jaxchat.common import quiet_jax_warnings, select_platform
    from jaxchat.distributed.mesh import maybe_initialize_distributed

    quiet_jax_warnings()  # first, so that starting the backend prints nothing of the libraries' either
    maybe_initialize_distributed()  # before anything touches a device
    select_platform(args.device_type)
    enable_compilation_cache(args.compilation_cache)  # before the first compile

    from jaxchat.data.tokenizer import get_tokenizer

    tokenizer = get_tokenizer()
    model_tag = args.model_tag or find_model_tag()
    model, meta = load_model(model_tag, args.step, tokenizer=tokenizer)
    return model, tokenizer, meta, model_tag


def find_model_tag(base_dir: str | None = None) -> str:
    """The run to load when none is named (jaxchat.checkpoint.run_directory.find_model_tag), as process 0 finds it."""
    from jaxchat.checkpoint import run_directory
    from jaxchat.common import get_base_dir
    from jaxchat.distributed.multihost import decided_by_process_0

    root = storage.join(base_dir or get_base_dir(), CHECKPOINTS_SUBDIR)
    return decided_by_process_0("model tag", lambda: run_directory.find_model_tag(root), (CheckpointError,))


def load_model(model_tag: str | None = None, step: int | None = None, base_dir: str | None = None,
               tokenizer=None, mesh=None, **model_kwargs):
    """(GPT, meta) of a checkpoint, built from its metadata alone, parameters replicated over `mesh` (default:
    every device; no optimizer state is read). model_tag None: find_model_tag; step None: the newest
    complete step. With a tokenizer, a vocabulary that differs from the model's is refused. model_kwargs go
    to GPT (dtype, attention_implementation)."""
    from flax import nnx

    from jaxchat.checkpoint.manager import RunCheckpoints, checkpoint_dir
    from jaxchat.common import print0
    from jaxchat.model.gpt import GPTConfig, abstract_model
    from jaxchat.distributed.mesh import make_mesh, replicated

    model_tag = model_tag or find_model_tag(base_dir)
    with RunCheckpoints(checkpoint_dir(model_tag, base_dir=base_dir), read_only=True) as ckpt:
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


# ---- a new run from given weights (--init-from) ---------------------------------------------------

def load_init_params(path: str, model_config, abstract_params, shardings, tokenizer=None, **model_kwargs):
    """The parameters of `path`, placed on `shardings`, for a new run (--init-from): a jaxchat run directory
    (its newest complete step), one of its step directories, or nanochat weights (model_<step>.pt or
    .safetensors, with meta_<step>.json beside them and the tokenizer.pkl of their nanochat base dir).
    Only the weights: optimizer, schedule, data and step start anew. CheckpointError, one line, if path is
    none of these, or its model or tokenizer is not this run's. model_kwargs: the run's GPT keyword
    arguments (recipe features), for nanochat's weights."""
    where = f"--init-from {path}"
    if storage.isfile(path):
        if storage.is_url(path):
            raise NoCheckpointError(f"{where}: nanochat's weights are read from a local file: copy it (and its "
                                    "meta_<step>.json) to this host first")
        return _nanochat_init_params(path, model_config, shardings, tokenizer, **model_kwargs)
    if not storage.isdir(path):
        raise NoCheckpointError(f"{where}: no such file or directory; give a jaxchat run directory, one of its step "
                                "directories, or nanochat's model_<step>.pt")
    from jaxchat.checkpoint.manager import RunCheckpoints
    from jaxchat.common import print0

    path = str(path).rstrip("/") if storage.is_url(path) else os.path.normpath(path)  # (normpath: gs:// -> gs:/)
    name = path.rsplit("/", 1)[-1] if storage.is_url(path) else os.path.basename(path)
    run_dir, step = (storage.dirname(path), int(name)) if name.isdigit() else (path, None)
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


def _nanochat_init_params(path: str, model_config, shardings, tokenizer, **model_kwargs):
    import jax
    from flax import nnx

    from jaxchat.checkpoint.meta import tokenizer_info
    from jaxchat.common import print0
    from jaxchat.export.nanochat import (config_from_nanochat_meta, from_nanochat_state_dict, load_nanochat_state_dict,
                                 load_nanochat_tokenizer, nanochat_tokenizer_path, read_nanochat_meta,
                                 recipe_of_state_dict)

    where = f"--init-from {path}"
    try:
        saved = config_from_nanochat_meta(read_nanochat_meta(path, None)[0], path)
        if tokenizer is not None:
            pickle_path = nanochat_tokenizer_path(path)
            if not os.path.exists(pickle_path):
                raise ValueError(f"no tokenizer to check it against ({pickle_path}, where nanochat keeps the model's): "
                                 "put the model's tokenizer.pkl there, or import it with python -m scripts.export "
                                 "--import FILE --tokenizer PATH and --init-from the imported run")
            if tokenizer_info(load_nanochat_tokenizer(pickle_path)) != tokenizer_info(tokenizer):
                raise ValueError(f"its tokenizer ({pickle_path}) is not this run's (the base dir's tokenizer/): train "
                                 "with the model's tokenizer (python -m scripts.export --import FILE puts it there)")
        state_dict = load_nanochat_state_dict(path)
        # nanochat's meta does not name the recipe: its parameter names do
        saved = dataclasses.replace(saved, recipe=recipe_of_state_dict(saved, state_dict))
        _check_init_config(where, dataclasses.asdict(saved), model_config)
        model = from_nanochat_state_dict(model_config, state_dict, **model_kwargs)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    print0(f"Initialised the weights from nanochat's {path}; optimizer, schedule and data start anew")
    return jax.device_put(nnx.state(model, nnx.Param), shardings)


def _check_init_config(where: str, saved: dict, model_config) -> None:
    from jaxchat.checkpoint.meta import config_differences

    problems = config_differences(saved, model_config)
    if problems:
        raise CheckpointMismatchError(f"{where}: another architecture than this run's ({'; '.join(problems)}): "
                                      "pass the flags and --recipe it was trained with")
