"""Evaluate a base model checkpoint on CORE (DCLM's 22 in-context tasks, arXiv 2406.11794, as nanochat's scripts/base_eval.py).

    python -m scripts.base_eval                              # the deepest model, its newest step
    python -m scripts.base_eval --model-tag d12 --step 5000 --max-per-task 100

Prints each task's accuracy and centered score and the CORE metric, writes them to
<base_dir>/base_eval/<model_tag>_<step>.csv and adds a section to the report. The eval bundle is
downloaded to <base_dir>/eval_bundle on first use. Multi-host: start it on every host as the train
script (the batches span all devices).
"""

import argparse
import csv
import io

from jaxchat import storage
from jaxchat.common import fail
from jaxchat.export.saved_model import LOAD_ERRORS, add_checkpoint_args, load_saved_model


def write_results_csv(path: str, results: dict, centered_results: dict, core_metric: float) -> None:
    storage.makedirs(storage.dirname(path))
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["Task", "Accuracy", "Centered"])
    for label, accuracy in results.items():
        writer.writerow([label, f"{accuracy:.6f}", f"{centered_results[label]:.6f}"])
    writer.writerow(["CORE", "", f"{core_metric:.6f}"])
    storage.write_text(path, text.getvalue())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Evaluate the CORE metric of a base model checkpoint")
    add_checkpoint_args(parser)
    parser.add_argument("--max-per-task", type=int, default=-1, help="examples per task (-1 = all)")
    parser.add_argument("--tokens-per-device", type=int, default=8192,
                        help="batch size in padded tokens per device (lower it if memory runs out)")
    args = parser.parse_args(argv)
    try:
        model, tokenizer, meta, model_tag = load_saved_model(args)
    except LOAD_ERRORS as e:
        fail(str(e))

    from jaxchat.common import get_base_dir, is_master, print0
    from jaxchat.eval.core import evaluate_core
    from jaxchat.report import Label, Section, get_report

    try:
        out = evaluate_core(model, tokenizer, max_per_task=args.max_per_task, tokens_per_device=args.tokens_per_device)
    except RuntimeError as e:  # the bundle could not be downloaded
        fail(str(e))
    results, centered, core_metric = out["results"], out["centered_results"], out["core_metric"]
    print0("=" * 64)
    print0(f"Model: {model_tag} step {meta['step']}")
    print0(f"{'Task':<35} {'Accuracy':>10} {'Centered':>10}")
    for label, accuracy in results.items():
        print0(f"{label:<35} {accuracy:>10.4f} {centered[label]:>10.4f}")
    print0(f"CORE metric: {core_metric:.4f}")
    if is_master():
        path = storage.join(get_base_dir(), "base_eval", f"{model_tag}_{meta['step']:06d}.csv")
        write_results_csv(path, results, centered, core_metric)
        print0(f"Results written to {path}")
        get_report().log(section=Section.BASE_EVALUATION, data=[
            {"Model": f"{model_tag} step {meta['step']}", Label.CORE: core_metric}, centered])


if __name__ == "__main__":
    main()
