"""Move models between jaxchat and nanochat: a model of --recipe bdcc030 goes to (and comes from) nanochat
at commit bdcc030, one of --recipe 92d63d4 to nanochat at 92d63d4 (its model_config does not name the
recipe: an import tells it from the parameter names).

Hand a base model to nanochat's later stages (midtraining, SFT, RL, chat):

    python -m scripts.export --to-nanochat ~/.cache/nanochat [--model-tag d20] [--step 21400]

writes what nanochat's load_model("base", ...) and get_tokenizer() read from that base directory:
base_checkpoints/<tag>/model_<step:06d>.pt + meta_<step:06d>.json, and tokenizer/tokenizer.pkl +
token_bytes.pt as the recipe's commit counts them (kept if the same tokenizer is there already; another one
is refused). Needs PyTorch: pip install -e '.[nanochat]'.

Hand it to Hugging Face (transformers, lm-evaluation-harness, the Hub): a directory that
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) and AutoTokenizer.from_pretrained(DIR)
load, checked against jaxchat's logits before it is written (jaxchat.export.hf). Needs pip install -e '.[hf]':

    python -m scripts.export --to-hf DIR [--model-tag d20] [--step 21400] [--overwrite] [--push-to-hub USER/REPO [--private]]

--push-to-hub uploads the files the export wrote, nothing else in DIR, to a public repository unless --private.

The weights alone, without PyTorch (safetensors, nanochat's names and layout, float32):

    python -m scripts.export [--output DIR]            # DIR: <base_dir>/nanochat_export/<tag>

Every export refuses to replace a file that is there already unless --overwrite, and never writes into
the base dir's own folders (base_checkpoints/, tokenizer/, the shards', report/): see jaxchat.checkpoint.staged_files.

Import nanochat weights as a jaxchat checkpoint (weights only: it can be evaluated and sampled, not
resumed, since nanochat's optimizer state does not map onto jaxchat's):

    python -m scripts.export --import ~/.cache/nanochat/base_checkpoints/d20/model_021400.pt [--model-tag TAG] [--step N]

The file is model_<step>.pt (needs PyTorch) or .safetensors; --meta defaults to meta_<step>.json beside
it, --tokenizer to tokenizer/tokenizer.pkl of the nanochat base directory it lies in (if there): the
tokenizer becomes <base_dir>/tokenizer (kept if the same one is there; another one is refused).
The step defaults to the meta's, the tag to d<n_layer>.
"""

import argparse
import dataclasses
import json
import os

import safetensors.numpy
from flax import nnx

from jaxchat.checkpoint.manager import RunCheckpoints, checkpoint_dir
from jaxchat.checkpoint.meta import (CHECKPOINTS_SUBDIR, TRAINING_META_KEYS, CheckpointError,
                                     model_tag_flag, nanochat_files, tokenizer_info)
from jaxchat.common import fail, get_base_dir, quiet_jax_warnings
from jaxchat.export.nanochat import (TOKEN_BYTES_PT, TOKENIZER_PICKLE, config_from_nanochat_meta, from_nanochat_state_dict,
                             holds_nanochat_token_bytes, jaxchat_folders, load_nanochat_state_dict, load_nanochat_tokenizer, nanochat_meta,
                             nanochat_tokenizer_path, read_nanochat_meta, recipe_of_state_dict,
                             save_nanochat_checkpoint, save_nanochat_tokenizer, to_nanochat_state_dict)
from jaxchat.export.saved_model import find_model_tag, load_model
from jaxchat.checkpoint.staged_files import StagedFiles, check_writable_dir
from jaxchat.data.tokenizer import TOKENIZER_SUBDIR, get_tokenizer


def _holds_tokenizer(existing, tokenizer, where: str, what_to_do: str) -> bool:
    """Whether `where` holds this tokenizer already (existing: what it holds, None if nothing). Another
    one is refused: the models beside it were trained with that one."""
    if existing is None:
        return False
    if tokenizer_info(existing) != tokenizer_info(tokenizer):
        raise ValueError(f"{where} holds another tokenizer ({existing.get_vocab_size()} tokens) than this "
                         f"model's ({tokenizer.get_vocab_size()}): {what_to_do}")
    return True


def export_to_nanochat(nanochat_dir: str, model_tag: str | None = None, step: int | None = None,
                       base_dir: str | None = None, overwrite: bool = False) -> list[str]:
    """Writes a jaxchat checkpoint and its tokenizer into a nanochat base directory; returns the files written.
    Everything is checked first and the files appear together: a failure leaves nanochat_dir as it was. A file
    there already is replaced only with overwrite (the same tokenizer is kept, another one refused)."""
    base_dir = base_dir or get_base_dir()
    tokenizer = get_tokenizer(os.path.join(base_dir, TOKENIZER_SUBDIR))
    model_tag = model_tag or find_model_tag(base_dir)
    model, meta = load_model(model_tag, step, base_dir, tokenizer=tokenizer)
    tokenizer_dir = os.path.join(nanochat_dir, TOKENIZER_SUBDIR)
    pickle_path = os.path.join(tokenizer_dir, TOKENIZER_PICKLE)
    existing = load_nanochat_tokenizer(pickle_path) if os.path.exists(pickle_path) else None
    keep_tokenizer = _holds_tokenizer(existing, tokenizer, tokenizer_dir,
                                      "export into another nanochat base dir, or move that tokenizer away")
    model_dir = os.path.join(nanochat_dir, CHECKPOINTS_SUBDIR, model_tag)
    recipe = model.config.recipe
    tokenizer_files = (TOKENIZER_PICKLE, TOKEN_BYTES_PT)
    if keep_tokenizer:  # its token_bytes.pt too, unless counted by the other commit's rule (or missing)
        same = holds_nanochat_token_bytes(os.path.join(tokenizer_dir, TOKEN_BYTES_PT), tokenizer, recipe)
        tokenizer_files = () if same else (TOKEN_BYTES_PT,)
    targets = [os.path.join(model_dir, name) for name in nanochat_files(meta["step"])]
    targets += [os.path.join(tokenizer_dir, name) for name in tokenizer_files]
    staged = StagedFiles(overwrite, keep_out=jaxchat_folders(base_dir))
    staged.check(targets)
    for directory in [model_dir] + ([tokenizer_dir] if tokenizer_files else []):
        check_writable_dir(directory)
    with staged:
        save_nanochat_checkpoint(model, meta, meta["step"], model_dir, staged)
        save_nanochat_tokenizer(tokenizer, tokenizer_dir, staged, recipe, names=tokenizer_files)
    return targets


def export_checkpoint(model_tag: str | None = None, step: int | None = None, output: str | None = None,
                      base_dir: str | None = None, overwrite: bool = False) -> tuple[str, str]:
    """Writes model_<step>.safetensors and meta_<step>.json (no PyTorch needed); returns their paths. Files
    there already are replaced only with overwrite."""
    base_dir = base_dir or get_base_dir()
    model_tag = model_tag or find_model_tag(base_dir)
    model, meta = load_model(model_tag, step, base_dir)
    step = meta["step"]
    output = output or os.path.join(base_dir, "nanochat_export", model_tag)
    weights_path, meta_path = (os.path.join(output, name) for name in nanochat_files(step, "safetensors"))
    staged = StagedFiles(overwrite, keep_out=jaxchat_folders(base_dir))
    staged.check([weights_path, meta_path])
    check_writable_dir(output)
    meta_json = json.dumps(nanochat_meta(meta, step), indent=2)
    with staged:  # both files or neither
        safetensors.numpy.save_file(to_nanochat_state_dict(model), staged.path(weights_path))
        with open(staged.path(meta_path), "w", encoding="utf-8") as f:
            f.write(meta_json)
    return weights_path, meta_path


def import_weights(weights_path: str, meta_path: str | None = None, tokenizer_path: str | None = None,
                   model_tag: str | None = None, step: int | None = None, base_dir: str | None = None) -> str:
    """Writes nanochat weights (.pt or .safetensors) as a weights-only jaxchat checkpoint, and nanochat's
    tokenizer (tokenizer_path; default: beside the weights in nanochat's layout, if there) as jaxchat's;
    returns the checkpoint's directory."""
    source_meta, meta_path = read_nanochat_meta(weights_path, meta_path)
    config = config_from_nanochat_meta(source_meta, meta_path)
    step = step if step is not None else source_meta.get("step")
    if step is None:
        raise ValueError(f"{meta_path} has no step: pass --step")
    state_dict = load_nanochat_state_dict(weights_path)
    config = dataclasses.replace(config, recipe=recipe_of_state_dict(config, state_dict))
    model = from_nanochat_state_dict(config, state_dict)
    base_dir = base_dir or get_base_dir()
    beside = nanochat_tokenizer_path(weights_path)
    tokenizer_path = tokenizer_path or (beside if os.path.exists(beside) else None)
    tokenizer_dir = os.path.join(base_dir, TOKENIZER_SUBDIR)
    tokenizer, keep_tokenizer = None, False
    if tokenizer_path:
        tokenizer = load_nanochat_tokenizer(tokenizer_path)
        if tokenizer.get_vocab_size() != config.vocab_size:
            raise ValueError(f"{tokenizer_path} has {tokenizer.get_vocab_size()} tokens, the model {config.vocab_size}: "
                             "pass the tokenizer the model was trained with (--tokenizer)")
        try:
            existing = get_tokenizer(tokenizer_dir)
        except FileNotFoundError:
            existing = None
        keep_tokenizer = _holds_tokenizer(existing, tokenizer, tokenizer_dir,
                                          "import into another base dir ($JAXCHAT_BASE_DIR), or move that tokenizer away")

    directory = checkpoint_dir(model_tag, config.n_layer, base_dir)
    for target in [directory] + ([tokenizer_dir] if tokenizer is not None and not keep_tokenizer else []):
        check_writable_dir(target)  # an unwritable place stops the import here, before the tokenizer is written
    kept = [key for key in TRAINING_META_KEYS if key not in ("model_config", "tokenizer")] + ["total_batch_size"]  # 92d63d4's
    meta = {key: source_meta[key] for key in kept if key in source_meta}
    meta.update(model_config=dataclasses.asdict(config), imported_from=os.path.abspath(weights_path),
                tokenizer=tokenizer_info(tokenizer) if tokenizer is not None else None)
    with RunCheckpoints(directory, async_save=False) as checkpointer:
        if checkpointer.all_steps():
            raise ValueError(f"{directory} already holds checkpoints {checkpointer.all_steps()}: "
                             "import under another --model-tag")
        if tokenizer is not None and not keep_tokenizer:
            tokenizer.save(tokenizer_dir)
        checkpointer.save(step, nnx.state(model, nnx.Param), None, None, meta)
    if tokenizer is None:
        print(f"No nanochat tokenizer given (--tokenizer) or beside the weights: the one in {tokenizer_dir} "
              "must be the model's")
    else:
        print(f"Tokenizer {tokenizer_path}: {'the same as' if keep_tokenizer else 'written to'} {tokenizer_dir}")
    return directory


def export_hf(directory: str, model_tag: str | None, step: int | None, overwrite: bool, repo: str | None,
              private: bool) -> None:
    from jaxchat.export.hf import CHECK_TOLERANCE, export_to_hf, push_to_hub

    written, difference = export_to_hf(directory, model_tag, step, overwrite=overwrite)
    for path in written:
        print(f"Wrote {path}")
    print(f"Checked: transformers' logits equal jaxchat's within {difference:.2g} (bound {CHECK_TOLERANCE}), the same token ids")
    print(f"Load it: AutoModelForCausalLM.from_pretrained({directory!r}, trust_remote_code=True)")
    if repo:
        print(f"Uploaded the files above to {push_to_hub(written, repo, private)} "
              f"({'private' if private else 'public'})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Hand a jaxchat checkpoint to nanochat, or import nanochat weights")
    parser.add_argument("--to-nanochat", type=str, default=None, metavar="NANOCHAT_BASE_DIR",
                        help="write the model and tokenizer into this nanochat base directory (e.g. ~/.cache/nanochat)")
    parser.add_argument("--to-hf", type=str, default=None, metavar="DIR",
                        help="write a Hugging Face transformers directory (config, safetensors, modeling code, tokenizer)")
    parser.add_argument("--overwrite", action="store_true", help="let an export replace files that are there already "
                        "(never in the base dir's own folders)")
    parser.add_argument("--push-to-hub", type=str, default=None, metavar="REPO",
                        help="with --to-hf: then upload the files written to this Hugging Face Hub model repository, "
                        "public unless --private (huggingface-cli login first)")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private "
                        "(an existing public one is refused)")
    parser.add_argument("--model-tag", type=model_tag_flag, default=None, help="checkpoint directory name (default: the deepest d<N>)")
    parser.add_argument("--step", type=int, default=None, help="step to export (default: the newest complete one); "
                        "with --import: the step to file it under (default: the meta's)")
    parser.add_argument("--output", type=str, default=None,
                        help="write safetensors weights here (default: <base_dir>/nanochat_export/<tag>)")
    parser.add_argument("--import", dest="import_file", type=str, default=None,
                        help="nanochat weights (model_<step>.pt or .safetensors) to import as a jaxchat checkpoint")
    parser.add_argument("--meta", type=str, default=None, help="with --import: nanochat's meta JSON "
                        "(default: meta_<step>.json beside the weights)")
    parser.add_argument("--tokenizer", type=str, default=None, help="with --import: nanochat's tokenizer.pkl "
                        "(default: <nanochat base dir>/tokenizer/tokenizer.pkl when the weights lie in its base_checkpoints)")
    args = parser.parse_args(argv)
    modes = [flag for flag, value in (("--to-nanochat", args.to_nanochat), ("--to-hf", args.to_hf),
                                      ("--output", args.output), ("--import", args.import_file)) if value]
    if len(modes) > 1:
        parser.error(f"{' and '.join(modes)} do not go together: export one way or import")
    if (args.meta or args.tokenizer) and not args.import_file:
        parser.error("--meta and --tokenizer are for --import")
    if args.push_to_hub and not args.to_hf:
        parser.error("--push-to-hub is for --to-hf")
    if args.private and not args.push_to_hub:
        parser.error("--private is for --push-to-hub")
    if args.overwrite and args.import_file:
        parser.error("--overwrite is for the exports: --import never replaces a checkpoint")
    for flag, path in (("--to-nanochat", args.to_nanochat), ("--to-hf", args.to_hf), ("--output", args.output),
                       ("--import", args.import_file)):
        if path and "://" in path:  # (the base dir may be a bucket: the model is read from there)
            parser.error(f"{flag} {path}: exports and imports use a local path (a bucket's objects cannot be staged "
                         "and renamed together); export locally, then copy it, e.g. `gcloud storage cp -r DIR gs://...`")

    quiet_jax_warnings()
    try:
        if args.import_file:
            directory = import_weights(args.import_file, args.meta, args.tokenizer, args.model_tag, args.step)
            print(f"Imported {args.import_file} into {directory}")
        elif args.to_hf:
            export_hf(args.to_hf, args.model_tag, args.step, args.overwrite, args.push_to_hub, args.private)
        elif args.to_nanochat:
            for path in export_to_nanochat(args.to_nanochat, args.model_tag, args.step, overwrite=args.overwrite):
                print(f"Wrote {path}")
        else:
            for path in export_checkpoint(args.model_tag, args.step, args.output, overwrite=args.overwrite):
                print(f"Wrote {path}")
    except (ValueError, OSError, ImportError, CheckpointError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
