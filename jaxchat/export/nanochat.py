"""Interchange with nanochat: its parameter names and layout, and the files its later stages read.

Each recipe's GPT is nanochat's at that commit (karpathy/nanochat): a 'bdcc030' model is read by a
checkout of bdcc030 (January 2026), a '92d63d4' model by one of 92d63d4; everything here follows those
commits' nanochat/gpt.py, nanochat/checkpoint_manager.py, nanochat/tokenizer.py and scripts/base_train.py
+ tok_train.py. Either commit's load_model loads strictly, so it refuses the other recipe's weights.

A nanochat base directory, as its load_model("base", ...) and get_tokenizer() read it:
  base_checkpoints/<tag>/model_<step:06d>.pt   torch.save'd state dict, names below; Linear weights are
                                               (out, in); wte (and 92d63d4's value_embeds) bfloat16
                                               (nanochat's init_weights casts them on CUDA and build_model
                                               upcasts on CPU), the rest float32
  base_checkpoints/<tag>/meta_<step:06d>.json  base_train.py's meta: model_config (GPTConfig's fields), ...
  tokenizer/tokenizer.pkl                      the pickled tiktoken.Encoding (RustBPETokenizer.save)
  tokenizer/token_bytes.pt                     int32 tensor, bytes of each token, 0 for specials (bdcc030:
                                               of the decoded token in UTF-8; 92d63d4: its raw bytes)

Names follow from the nnx parameter paths by rule: blocks.<i>.<sub>.<layer>.kernel is
transformer.h.<i>.<sub>.<layer>.weight transposed (Flax kernels are (in, out)), wte.embedding is
transformer.wte.weight, lm_head.kernel is lm_head.weight transposed, the lambdas keep their names;
92d63d4's value_embeds.<i>.embedding is value_embeds.<i>.weight and smear_gate.kernel smear_gate.weight
transposed. The recipe is not in nanochat's model_config (its GPTConfig has no such field): an import
tells it from the parameter names.

PyTorch is needed only for the .pt files (pip install -e '.[nanochat]'). jaxchat never runs pickle
code: state dicts are read with torch.load(weights_only=True), and tokenizer.pkl by an unpickler
that resolves the one class such a file names to a record of its data (see load_nanochat_tokenizer).
"""

import contextlib
import dataclasses
import json
import os
import pickle
import zipfile

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.checkpoint.meta import CHECKPOINTS_SUBDIR, NANOCHAT_WEIGHTS_FILE, nanochat_files
from jaxchat.model.gpt import DEFAULT_RECIPE, GPT, RECIPES, GPTConfig, abstract_model
from jaxchat.report import REPORT_SUBDIR
from jaxchat.data.shards import CORPORA
from jaxchat.checkpoint.staged_files import StagedFiles
from jaxchat.data.tokenizer import TOKENIZER_SUBDIR, Tokenizer

TORCH_COMPILE_PREFIX = "_orig_mod."  # nanochat state dicts saved from a compiled model carry it
# What nanochat's base_train.py writes into meta_<step>.json, in its order: bdcc030's, and per recipe
# (92d63d4 adds the total batch size after max_seq_len, which its chat_sft.py inherits).
NANOCHAT_META_KEYS = ("step", "val_bpb", "model_config", "user_config", "device_batch_size", "max_seq_len",
                      "dataloader_state_dict", "loop_state")
META_KEYS_OF_RECIPE = {"bdcc030": NANOCHAT_META_KEYS,
                       "92d63d4": NANOCHAT_META_KEYS[:6] + ("total_batch_size",) + NANOCHAT_META_KEYS[6:]}
# The fields of nanochat's GPTConfig (nanochat/gpt.py, the same at both commits): its build_model passes
# model_config to it as is.
NANOCHAT_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")
# nanochat trains with its embedding tables in bfloat16 on GPU and saves them so (init_weights).
NANOCHAT_BF16_TABLES = ("transformer.wte.weight", "value_embeds.")
TOKENIZER_PICKLE = "tokenizer.pkl"
TOKEN_BYTES_PT = "token_bytes.pt"
# nanochat's RustBPETokenizer names its encoding so; tiktoken pickles a registered name ("gpt2", ...)
# by reference, so the name must not be one of tiktoken's own.
ENCODING_NAME = "rustbpe"
INSTALL_HINT = ("pip install -e '.[nanochat]' (CPU-only build: "
                "pip install torch --index-url https://download.pytorch.org/whl/cpu)")

_PREFIXES = {"wte": "transformer.wte", "blocks": "transformer.h"}
_LEAVES = {"kernel": ("weight", True), "embedding": ("weight", False)}  # nnx leaf -> (torch leaf, transpose?)


def import_torch():
    """torch, or an ImportError saying how to install it (it is an optional dependency)."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"nanochat's .pt files need PyTorch, which is not installed: {INSTALL_HINT}") from e
    return torch


def jaxchat_folders(base_dir: str) -> list[str]:
    """The folders of a jaxchat base dir that no export may write into (StagedFiles' keep_out): the runs'
    checkpoints (a step's directory goes with its step), the tokenizer every run reads, the corpora's
    shards, and the report (its reset removes every .md and .json there)."""
    names = [CHECKPOINTS_SUBDIR, TOKENIZER_SUBDIR, REPORT_SUBDIR, *(corpus.dir_name for corpus in CORPORA.values())]
    return [os.path.join(base_dir, name) for name in names]


# ---- parameter names and layout ------------------------------------------------------------------

def nanochat_name(path: tuple) -> tuple[str, bool]:
    """(nanochat's name, transpose?) of the nnx parameter at `path`, e.g. ('blocks', 0, 'attn', 'c_q',
    'kernel') -> ('transformer.h.0.attn.c_q.weight', True)."""
    parts = [str(p) for p in path]
    parts[0] = _PREFIXES.get(parts[0], parts[0])
    transpose = False
    if parts[-1] in _LEAVES:
        parts[-1], transpose = _LEAVES[parts[-1]]
    return ".".join(parts), transpose


def _flat_params(model: GPT) -> dict[tuple, jax.Array]:
    return flax.traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def to_nanochat_state_dict(model: GPT) -> dict[str, np.ndarray]:
    """nanochat's parameter names, PyTorch (out, in) layout, padded vocabulary rows kept; float32 numpy."""
    out = {}
    for path, value in _flat_params(model).items():
        name, transpose = nanochat_name(path)
        value = np.asarray(jax.device_get(value), dtype=np.float32)
        out[name] = np.ascontiguousarray(value.T) if transpose else value
    return out


def _expected_names(config: GPTConfig, **model_kwargs) -> tuple[GPT, dict[tuple, tuple[str, bool]]]:
    model = abstract_model(config, **model_kwargs)
    return model, {path: nanochat_name(path) for path in _flat_params(model)}


def recipe_of_state_dict(config: GPTConfig, names) -> str:
    """The recipe whose GPT of config's shape has exactly these parameter names (nanochat's model_config
    does not say); the nearest one when none does, so that the load names what differs."""
    def difference(recipe):
        expected = {name for name, _ in _expected_names(dataclasses.replace(config, recipe=recipe))[1].values()}
        return len(expected ^ set(names))

    return min(RECIPES, key=difference)


def from_nanochat_state_dict(config: GPTConfig, state_dict: dict[str, np.ndarray], **model_kwargs) -> GPT:
    """The inverse of to_nanochat_state_dict: a GPT of `config` holding exactly those weights (as float32)."""
    model, names = _expected_names(config, **model_kwargs)
    expected = {name for name, _ in names.values()}
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"the weights do not match model_config (recipe {config.recipe}): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    flat = {}
    for path, abstract in _flat_params(model).items():
        name, transpose = names[path]
        value = np.asarray(state_dict[name], dtype=np.float32)
        value = value.T if transpose else value
        if value.shape != abstract.shape:
            shape = value.shape[::-1] if transpose else value.shape
            wanted = abstract.shape[::-1] if transpose else abstract.shape
            raise ValueError(f"{name}: shape {shape}, expected {wanted} for this model_config")
        flat[path] = jnp.asarray(value)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, flax.traverse_util.unflatten_dict(flat))
    nnx.update(model, state)
    return model


# ---- meta_<step>.json ----------------------------------------------------------------------------

def nanochat_meta(meta: dict, step: int) -> dict:
    """nanochat's meta for a jaxchat checkpoint's meta: the keys of its recipe's base_train.py in that
    order, model_config without the recipe (nanochat's GPTConfig has no such field). The data loader's
    state means nothing to nanochat's loader (None: nanochat's stages never read it)."""
    config = dataclasses.asdict(GPTConfig(**meta["model_config"]))  # every field, defaults included
    recipe = config.pop("recipe")
    unknown = sorted(set(config) - set(NANOCHAT_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"model_config fields {unknown} have no counterpart in nanochat {recipe}'s GPT")
    out = {key: meta.get(key) for key in META_KEYS_OF_RECIPE[recipe]}
    out.update(step=step, dataloader_state_dict=None, model_config=config)
    if "total_batch_size" in out and out["total_batch_size"] is None:
        out["total_batch_size"] = (meta.get("user_config") or {}).get("total_batch_size")
    return out


def config_from_nanochat_meta(meta: dict, where: str, recipe: str = "bdcc030") -> GPTConfig:
    """The GPTConfig of a nanochat meta file for a model of that recipe, with nanochat's own default for
    models from before sliding windows (checkpoint_manager.py's _patch_missing_config_keys: full attention)."""
    config = dict(meta.get("model_config") or {})
    if not config:
        raise ValueError(f"{where} has no model_config: it is not a nanochat meta file")
    if "window_pattern" not in config:
        config["window_pattern"] = "L"
        print("model_config has no window_pattern (an older nanochat model): using 'L', full attention")
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise ValueError(f"{where}: model_config keys {unknown} are not part of jaxchat's GPT: this model has "
                         f"features jaxchat does not implement (it follows nanochat {', '.join(RECIPES)})")
    return GPTConfig(**{"recipe": recipe, **config})


# ---- model_<step>.pt -----------------------------------------------------------------------------

def save_nanochat_checkpoint(model: GPT, meta: dict, step: int, directory: str,
                             staged: StagedFiles | None = None) -> tuple[str, str]:
    """Writes model_<step:06d>.pt and meta_<step:06d>.json into `directory` as nanochat's
    save_checkpoint does; returns their paths. Both appear together when `staged` (or, without it, this
    call) ends without an error; files there already are replaced only as `staged` allows (by default not)."""
    torch = import_torch()
    model_path, meta_path = (os.path.join(directory, name) for name in nanochat_files(step))
    nanochat_meta_json = json.dumps(nanochat_meta(meta, step), indent=2)  # its errors before any write
    state_dict = {}
    for name, value in to_nanochat_state_dict(model).items():
        tensor = torch.tensor(value)  # a copy: the array may be a read-only view of device memory
        # as nanochat saves its embedding tables (NANOCHAT_BF16_TABLES); rounding to nearest even
        state_dict[name] = tensor.to(torch.bfloat16) if name.startswith(NANOCHAT_BF16_TABLES) else tensor
    with contextlib.nullcontext(staged) if staged else StagedFiles() as files:
        torch.save(state_dict, files.path(model_path))
        with open(files.path(meta_path), "w", encoding="utf-8") as f:
            f.write(nanochat_meta_json)
    return model_path, meta_path


def load_nanochat_state_dict(path: str) -> dict[str, np.ndarray]:
    """nanochat weights from model_<step>.pt (torch.load with weights_only=True: tensors only, no
    pickled code) or from a .safetensors file, as float32 numpy, torch.compile's name prefix removed."""
    if path.endswith(".safetensors"):
        import safetensors.numpy

        try:
            raw = safetensors.numpy.load_file(path)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError (and others) on garbage
            raise ValueError(f"{path} is not a safetensors file, or a damaged one ({type(e).__name__}: {e})") from None
        arrays = {name: np.asarray(value, dtype=np.float32) for name, value in raw.items()}
    elif path.endswith(".pt"):
        torch = import_torch()
        if not zipfile.is_zipfile(path):  # torch.save's format since PyTorch 1.6, nanochat's
            raise ValueError(f"{path} is not a PyTorch checkpoint (not the zip archive torch.save writes; "
                             "a truncated copy looks so too)")
        try:
            raw = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:  # its pickle names a class or function: only tensors are read
            refused = str(e.__context__ or "").strip().splitlines()[:1] or ["it names more than tensors"]
            raise ValueError(f"{path} holds more than tensors, so it is not read ({refused[0]}): nanochat's model "
                             "files hold tensors only") from None
        except (RuntimeError, EOFError, KeyError, ValueError) as e:  # a damaged archive
            raise ValueError(f"{path} is not a PyTorch checkpoint, or a damaged one "
                             f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} holds a {type(raw).__name__}, not nanochat's state dict")
        arrays = {name: value.detach().float().numpy() for name, value in raw.items()}
    else:
        raise ValueError(f"{path}: nanochat weights are model_<step>.pt or .safetensors files")
    return {name.removeprefix(TORCH_COMPILE_PREFIX): value for name, value in arrays.items()}


def default_meta_path(weights_path: str) -> str:
    match = NANOCHAT_WEIGHTS_FILE.search(os.path.basename(weights_path))
    if not match:
        raise ValueError(f"cannot tell the step of {weights_path} (not model_<step>.pt or .safetensors): pass --meta")
    return os.path.join(os.path.dirname(weights_path), nanochat_files(int(match.group(1)))[1])


def nanochat_tokenizer_path(weights_path: str) -> str:
    """tokenizer/tokenizer.pkl of the nanochat base dir that holds base_checkpoints/<tag>/model_<step>.pt."""
    nanochat_dir = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(weights_path))))
    return os.path.join(nanochat_dir, TOKENIZER_SUBDIR, TOKENIZER_PICKLE)


def read_nanochat_meta(weights_path: str, meta_path: str | None) -> tuple[dict, str]:
    """(nanochat's meta, its path): --meta, or meta_<step>.json beside the weights."""
    given = meta_path is not None
    meta_path = meta_path or default_meta_path(weights_path)
    try:
        with open(meta_path, encoding="utf-8") as f:
            return json.load(f), meta_path
    except FileNotFoundError:
        missing = f"--meta {meta_path} does not exist" if given else \
            f"no meta file beside the weights ({meta_path}, where nanochat writes it)"
        raise ValueError(f"{missing}: pass the meta file's path with --meta") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{meta_path} is not a nanochat meta file (not JSON: {e}): pass the right one with --meta") from None

# ---- tokenizer.pkl and token_bytes.pt ------------------------------------------------------------

def nanochat_token_bytes(tokenizer: Tokenizer, recipe: str) -> np.ndarray:
    """int32 bytes per token id as the recipe's commit of nanochat's tok_train.py counts them, 0 for special
    tokens; nanochat's bits per byte divide by these. 92d63d4 counts raw bytes (decode_single_token_bytes),
    as jaxchat does; bdcc030 the UTF-8 length of the decoded token, where a lone piece of a multi-byte
    character counts as U+FFFD, 3 bytes."""
    if recipe != "bdcc030":
        return tokenizer.token_bytes()
    special = set(tokenizer.get_special_tokens())
    lengths = []
    for token_id in range(tokenizer.get_vocab_size()):
        text = tokenizer.id_to_token(token_id)
        lengths.append(0 if text in special else len(text.encode("utf-8")))
    return np.asarray(lengths, dtype=np.int32)


def holds_nanochat_token_bytes(path: str, tokenizer: Tokenizer, recipe: str) -> bool:
    """Whether `path` is a token_bytes.pt of this tokenizer as the recipe's commit counts them (not when
    missing, unreadable, or counted by the other commit's rule)."""
    torch = import_torch()
    try:
        held = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 -- missing or damaged: torch raises OSError, RuntimeError, pickle's errors...
        return False
    return isinstance(held, torch.Tensor) and held.tolist() == nanochat_token_bytes(tokenizer, recipe).tolist()


def save_nanochat_tokenizer(tokenizer: Tokenizer, directory: str, staged: StagedFiles | None = None,
                            recipe: str = DEFAULT_RECIPE, names: tuple[str, ...] = (TOKENIZER_PICKLE, TOKEN_BYTES_PT)) -> None:
    """tokenizer.pkl (the tiktoken Encoding nanochat's RustBPETokenizer pickles) and token_bytes.pt as the
    recipe's commit counts them, or those of them in `names`; they appear when `staged` (or, without it,
    this call) ends without an error."""
    import tiktoken

    torch = import_torch()
    encoding = tiktoken.Encoding(name=ENCODING_NAME, pat_str=tokenizer.pattern,
                                 mergeable_ranks=tokenizer.mergeable_ranks, special_tokens=tokenizer.special_tokens)
    with contextlib.nullcontext(staged) if staged else StagedFiles() as files:
        if TOKENIZER_PICKLE in names:
            with open(files.path(os.path.join(directory, TOKENIZER_PICKLE)), "wb") as f:
                pickle.dump(encoding, f)
        if TOKEN_BYTES_PT in names:
            with open(files.path(os.path.join(directory, TOKEN_BYTES_PT)), "wb") as f:
                torch.save(torch.from_numpy(nanochat_token_bytes(tokenizer, recipe)), f)


class _EncodingRecord:
    """Stands in for tiktoken.Encoding while unpickling: keeps the state it is given, runs nothing."""

    def __setstate__(self, state):
        self.state = state


class _EncodingUnpickler(pickle.Unpickler):
    # Pickle executes code only through the globals it names; this one names a single class, which
    # resolves to the record above, and anything else stops the read.
    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _EncodingRecord
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; a nanochat tokenizer.pkl names only "
                                     "tiktoken.core.Encoding")


def load_nanochat_tokenizer(path: str) -> Tokenizer:
    """jaxchat's Tokenizer from nanochat's tokenizer.pkl, read without running any pickled code."""
    try:
        with open(path, "rb") as f:
            record = _EncodingUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a nanochat tokenizer: {e}") from e
    state = getattr(record, "state", None)
    if isinstance(state, str):
        raise ValueError(f"{path} names tiktoken's built-in encoding {state!r}, not a trained vocabulary: "
                         "jaxchat takes nanochat's own (rustbpe) tokenizers only")
    if not (isinstance(state, dict) and isinstance(state.get("pat_str"), str)
            and isinstance(state.get("mergeable_ranks"), dict) and isinstance(state.get("special_tokens"), dict)):
        raise ValueError(f"{path} is not a pickled tiktoken Encoding (nanochat's tokenizer.pkl)")
    special = state["special_tokens"]
    names = sorted(special, key=special.get)
    tokenizer = Tokenizer(state["mergeable_ranks"], state["pat_str"], names)
    if tokenizer.special_tokens != special:
        raise ValueError(f"{path}: special token ids {special} do not follow the merge ranks in order")
    return tokenizer
