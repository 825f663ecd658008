"""Continue a prompt with a base model checkpoint.

    python -m scripts.sample -p "The capital of France is"
    python -m scripts.sample -p "Once upon a time" -n 3 -t 0.8 -k 50 -m 128
    python -m scripts.sample -t 0                                # greedy, from BOS alone

Uses the KV-cache engine: the prompt is prefilled once for all samples, then one decode step per token.
"""

import argparse

from jaxchat.common import fail
from jaxchat.export.saved_model import LOAD_ERRORS, add_checkpoint_args, load_saved_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sample from a base model checkpoint")
    add_checkpoint_args(parser)
    parser.add_argument("-p", "--prompt", type=str, default="", help="text to continue (empty: start from BOS alone)")
    parser.add_argument("-n", "--num-samples", type=int, default=1, help="samples of the prompt")
    parser.add_argument("-m", "--max-tokens", type=int, default=64, help="tokens to generate per sample")
    parser.add_argument("-t", "--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("-k", "--top-k", type=int, default=50, help="sample among the k likeliest tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    try:
        model, tokenizer, _, _ = load_saved_model(args)
    except LOAD_ERRORS as e:
        fail(str(e))

    from jaxchat.common import print0
    from jaxchat.model.engine import Engine

    engine = Engine(model, tokenizer)
    tokens = tokenizer.encode(args.prompt, prepend=tokenizer.get_bos_token_id())
    try:
        samples, _ = engine.generate_batch(tokens, num_samples=args.num_samples, max_tokens=args.max_tokens,
                                           temperature=args.temperature, top_k=args.top_k or None, seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    for sample in samples:
        print0("-" * 80)
        print0(tokenizer.decode(sample[1:]))  # without the BOS


if __name__ == "__main__":
    main()
