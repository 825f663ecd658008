"""Bits per byte of a base model checkpoint on training and validation data, plus greedy samples.

    python -m scripts.base_loss
    python -m scripts.base_loss --model-tag d12 --split-tokens 1048576 --device-batch-size 16

Both splits are read from the start (the training split of this run's data, the validation shard),
packed as in training, at the checkpoint's sequence length. Adds a section to the report.
"""

import argparse

from jaxchat.common import fail
from jaxchat.export.saved_model import LOAD_ERRORS, add_checkpoint_args, load_saved_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Bits per byte and samples of a base model checkpoint")
    add_checkpoint_args(parser)
    parser.add_argument("--device-batch-size", type=int, default=32, help="rows per device per batch")
    parser.add_argument("--split-tokens", type=int, default=20 * 524288, help="tokens to evaluate per split")
    parser.add_argument("--data-dir", type=str, default=None, help="parquet shards (default: <base_dir>/base_data)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer, meta, model_tag = load_saved_model(args)
    except LOAD_ERRORS as e:
        fail(str(e))

    import jax

    from jaxchat.common import is_master, print0
    from jaxchat.data.loader import make_train_loader, make_val_loader
    from jaxchat.model.engine import SAMPLE_PROMPTS, Engine
    from jaxchat.eval.bpb import evaluate_bpb
    from jaxchat.report import Label, Section, get_report
    from jaxchat.data.tokenizer import get_token_bytes

    seq_len = meta["model_config"]["sequence_len"]
    local_rows = args.device_batch_size * jax.local_device_count()
    steps = args.split_tokens // (args.device_batch_size * seq_len * jax.device_count())
    if steps == 0:
        fail(f"--split-tokens {args.split_tokens} is less than one batch "
             f"({args.device_batch_size * seq_len * jax.device_count()} tokens)")
    print0(f"Evaluating {model_tag} step {meta['step']}: {steps} batches of {args.device_batch_size} x {seq_len} "
           f"tokens per device per split")
    try:
        token_bytes = get_token_bytes()
    except LOAD_ERRORS as e:  # missing or cut short
        fail(str(e))
    where = (jax.process_index(), jax.process_count())
    bpb = {}
    for split in ("train", "val"):
        loader = None
        try:
            if split == "train":  # the endless training stream, one micro-batch per step
                loader = make_train_loader(tokenizer, local_rows, seq_len, 1, *where, data_dir=args.data_dir)
                batches = ((inputs[0], targets[0]) for inputs, targets in loader)
            else:
                batches = make_val_loader(tokenizer, local_rows, seq_len, *where, steps=steps, data_dir=args.data_dir)
            bpb[split] = evaluate_bpb(model, batches, steps, token_bytes)
        except (FileNotFoundError, ValueError) as e:
            fail(str(e))
        finally:
            if loader is not None:
                loader.close()  # stops its background readers
        print0(f"{split} bpb: {bpb[split]:.4f}")

    engine = Engine(model, tokenizer)  # every process runs it (the parameters span all devices)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        tokens = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
        sample, _ = engine.generate_batch(tokens, num_samples=1, max_tokens=16, temperature=0)
        samples.append(tokenizer.decode(sample[0][1:]))
        print0(samples[-1])
    if is_master():
        get_report().log(section=Section.BASE_LOSS, data=[
            {"Model": f"{model_tag} step {meta['step']}", Label.TRAIN_BPB: bpb["train"], Label.VAL_BPB: bpb["val"]},
            {f"sample {i}": sample for i, sample in enumerate(samples)}])


if __name__ == "__main__":
    main()
