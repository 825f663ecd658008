"""Move weights between jaxchat and nanochat.

Export a jaxchat checkpoint for nanochat's tools:

    python -m scripts.export [--model-tag d20] [--step 21400] [--output DIR]

writes DIR/model_<step:06d>.safetensors (nanochat's parameter names, PyTorch (out, in) layout,
float32, padded vocabulary rows kept) and DIR/meta_<step:06d>.json (the keys nanochat's
base_train.py writes; its loader reads model_config). DIR defaults to
<base_dir>/nanochat_export/<model_tag>. nanochat reads model_<step>.pt with torch.load; torch is
not a jaxchat dependency, so convert where torch is installed:

    import torch
    from safetensors.torch import load_file
    torch.save(load_file("model_021400.safetensors"), "model_021400.pt")

and put model_021400.pt and meta_021400.json in ~/.cache/nanochat/base_checkpoints/d20/ (nanochat
then loads it with `load_model("base", device, phase="eval")`; it also needs its tokenizer with
the same vocabulary). nanochat's own checkpoints keep wte in bfloat16 on GPU; float32 loads the same.

Import nanochat weights as a jaxchat checkpoint (weights only: it can be evaluated and sampled,
not resumed, since nanochat's optimizer state does not map onto jaxchat's):

    python -m scripts.export --import model_021400.safetensors [--meta meta_021400.json] [--model-tag TAG] [--step N]

--meta defaults to meta_<step>.json beside the weights; the step to the meta's; the tag to
d<n_layer>. From a nanochat .pt, make the safetensors file with torch first:

    import torch
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in torch.load("model_021400.pt", map_location="cpu").items()}, "model_021400.safetensors")
"""

import argparse
import dataclasses
import json
import os
import re

import safetensors.numpy
from flax import nnx

from jaxchat.checkpoint import CHECKPOINTS_SUBDIR, Checkpointer, find_model_tag, load_model
from jaxchat.common import get_base_dir
from jaxchat.gpt import GPTConfig, from_nanochat_state_dict, to_nanochat_state_dict

# What nanochat's base_train.py writes into meta_<step>.json, in its order.
NANOCHAT_META_KEYS = ("step", "val_bpb", "model_config", "user_config", "device_batch_size", "max_seq_len",
                      "dataloader_state_dict", "loop_state")
TORCH_COMPILE_PREFIX = "_orig_mod."  # nanochat state dicts saved from a compiled model carry it


def export_checkpoint(model_tag: str | None = None, step: int | None = None, output: str | None = None,
                      base_dir: str | None = None) -> tuple[str, str]:
    """Writes model_<step>.safetensors and meta_<step>.json for nanochat; returns their paths."""
    base_dir = base_dir or get_base_dir()
    model_tag = model_tag or find_model_tag(os.path.join(base_dir, CHECKPOINTS_SUBDIR))
    model, meta = load_model(model_tag, step, base_dir)
    step = meta["step"]
    output = output or os.path.join(base_dir, "nanochat_export", model_tag)
    os.makedirs(output, exist_ok=True)
    weights_path = os.path.join(output, f"model_{step:06d}.safetensors")
    meta_path = os.path.join(output, f"meta_{step:06d}.json")
    safetensors.numpy.save_file(to_nanochat_state_dict(model), weights_path)
    # jaxchat's data loader state means nothing to nanochat's loader; the rest carries over as is
    nanochat_meta = {key: meta.get(key) for key in NANOCHAT_META_KEYS if key != "dataloader_state_dict"}
    nanochat_meta["dataloader_state_dict"] = None
    nanochat_meta["model_config"] = dataclasses.asdict(GPTConfig(**meta["model_config"]))
    with open(meta_path, "w", encoding="utf-8") as f:
        json.dump({key: nanochat_meta[key] for key in NANOCHAT_META_KEYS}, f, indent=2)
    return weights_path, meta_path


def _default_meta_path(weights_path: str) -> str:
    match = re.search(r"model_(\d+)\.safetensors$", os.path.basename(weights_path))
    if not match:
        raise ValueError(f"cannot tell the step of {weights_path} (not model_<step>.safetensors): pass --meta")
    return os.path.join(os.path.dirname(weights_path), f"meta_{match.group(1)}.json")


def _model_config(meta: dict, meta_path: str) -> GPTConfig:
    config = dict(meta.get("model_config") or {})
    if not config:
        raise ValueError(f"{meta_path} has no model_config: it is not a nanochat meta file")
    if "window_pattern" not in config:  # nanochat's own rule for checkpoints from before sliding windows
        config["window_pattern"] = "L"
        print("model_config has no window_pattern (an older nanochat model): using 'L', full attention")
    unknown = sorted(set(config) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise ValueError(f"{meta_path}: model_config keys {unknown} are not part of jaxchat's GPT: this model "
                         "has features jaxchat does not implement")
    return GPTConfig(**config)


def import_weights(weights_path: str, meta_path: str | None = None, model_tag: str | None = None,
                   step: int | None = None, base_dir: str | None = None) -> str:
    """Writes nanochat weights (safetensors) as a weights-only jaxchat checkpoint; returns its directory."""
    meta_path = meta_path or _default_meta_path(weights_path)
    with open(meta_path, encoding="utf-8") as f:
        nanochat_meta = json.load(f)
    config = _model_config(nanochat_meta, meta_path)
    step = step if step is not None else nanochat_meta.get("step")
    if step is None:
        raise ValueError(f"{meta_path} has no step: pass --step")
    state_dict = {name.removeprefix(TORCH_COMPILE_PREFIX): value
                  for name, value in safetensors.numpy.load_file(weights_path).items()}
    model = from_nanochat_state_dict(config, state_dict)
    directory = os.path.join(base_dir or get_base_dir(), CHECKPOINTS_SUBDIR, model_tag or f"d{config.n_layer}")
    meta = {key: nanochat_meta[key] for key in ("val_bpb", "user_config", "device_batch_size", "max_seq_len", "loop_state")
            if key in nanochat_meta}
    meta.update(model_config=dataclasses.asdict(config), imported_from=os.path.abspath(weights_path), tokenizer=None)
    with Checkpointer(directory, async_save=False) as checkpointer:
        if checkpointer.all_steps():
            raise ValueError(f"{directory} already holds checkpoints {checkpointer.all_steps()}: "
                             "import under another --model-tag")
        checkpointer.save(step, nnx.state(model, nnx.Param), None, None, meta)
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export a jaxchat checkpoint for nanochat, or import nanochat weights")
    parser.add_argument("--model-tag", type=str, default=None, help="checkpoint directory name (default: the deepest d<N>)")
    parser.add_argument("--step", type=int, default=None, help="step to export (default: the newest complete one); "
                        "with --import: the step to file it under (default: the meta's)")
    parser.add_argument("--output", type=str, default=None, help="export directory (default: <base_dir>/nanochat_export/<tag>)")
    parser.add_argument("--import", dest="import_file", type=str, default=None,
                        help="nanochat weights (model_<step>.safetensors) to import as a jaxchat checkpoint")
    parser.add_argument("--meta", type=str, default=None, help="with --import: nanochat's meta JSON "
                        "(default: meta_<step>.json beside the weights)")
    args = parser.parse_args(argv)
    if args.import_file:
        if args.output:
            parser.error("--output is for exporting; an import goes to <base_dir>/base_checkpoints/<model tag>")
        directory = import_weights(args.import_file, args.meta, args.model_tag, args.step)
        print(f"Imported {args.import_file} into {directory}")
    else:
        if args.meta:
            parser.error("--meta is for --import")
        weights_path, meta_path = export_checkpoint(args.model_tag, args.step, args.output)
        print(f"Wrote {weights_path}\nWrote {meta_path}")


if __name__ == "__main__":
    main()
