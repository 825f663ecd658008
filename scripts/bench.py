"""
Benchmarks that print a table (and can write JSON). Speed is measured here, never in tests.

  python -m scripts.bench train --depth 4 --max-seq-len 512 --device-batch-size 4 --vocab-size 8192
  python -m scripts.bench train --depth 12 --window-pattern SSSL L          # one row per pattern
  python -m scripts.bench train --depth 4 --profile-steps 0:3     # and a jax.profiler trace of 3 more steps
  python -m scripts.bench loader --builtin --vocab-size 8192
  python -m scripts.bench checkpoint --depth 4 --vocab-size 8192
  python -m scripts.bench decode --depth 4 --max-seq-len 512 --vocab-size 8192
  python -m scripts.bench memory --depth 20 --device-batch-size 32 --devices 8  # no GPU needed

train: the real train step (model, Muon + AdamW, gradient accumulation, shardings) on random tokens:
compile time, steady-state step time, tok/s, model FLOP/s (nanochat's estimate_flops per token),
MFU against the device's bf16 peak -- on a CPU against a float32 matmul rate measured here --,
peak memory, the time of forward+backward alone and of one optimizer update alone, and XLA's
cost_analysis FLOPs of forward+backward against estimate_flops (how much extra work the compiled
graph does: attention masks computed in full, norms, softmax, the loss).

checkpoint: how long the train loop is blocked by an asynchronous save against a blocking one, and
the size of a step on disk (and, by eval_shape arithmetic, the size of params + optimizer state).

decode: generation speed with the KV-cache engine against re-running the full forward per token.

memory: what one device holds during a train step, from abstract shapes on the CPU (no GPU, nothing
allocated): parameters, optimizer state and gradients in their shardings, the activations the backward
pass keeps (JAX's saved residuals, bf16 compute), the largest tensors of the step lowered for CUDA, the
total against a device's memory; with --devices N, the collectives of one step compiled on N virtual
CPU devices, the bytes each device moves, and their ratio to ZeRO-1's minimum.

loader: the data loader's throughput in tokens/s, the share of tokens cropped by best-fit packing,
its CPU cost, and the size and restore time of its checkpoint state.
"""

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import tempfile
import time

if __name__ == "__main__":  # before JAX is imported: the train step as scripts.train runs it (jaxchat.distributed.huge_pages)
    from jaxchat.distributed.huge_pages import reexec_with_huge_pages

    reexec_with_huge_pages()

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.common import fail, format_table, local_dir, quiet_jax_warnings, tree_nbytes
from jaxchat.model.engine import Engine
from jaxchat.model.gpt import GPT, REMAT_POLICIES, GPTConfig
from jaxchat.compiled.hlo import SLICED_ALL_REDUCE
from jaxchat.distributed.huge_pages import huge_pages_note
from jaxchat.compiled.memory import memory_estimate
from jaxchat.train.profiling import ProfileStepsError, StepProfiler, parse_profile_steps
from jaxchat.train.run import RunSettings, build_run
from jaxchat.distributed.runtime import GPU_MEMORY_FRACTION
from jaxchat.checkpoint.staged_files import make_parent_dir
from jaxchat.train.step_timing import time_train_step

TARGET_TOKENS_PER_S = 1e6  # what a d20 run on 8 H100s consumes per host
FINEWEB_CROPPED_FRACTION = 0.35  # nanochat's figure for best-fit packing at T=2048 on FineWeb-Edu
DEFAULTS = RunSettings()  # scripts.train's defaults: the model shape flags below default to them
SPEEDRUN_VOCAB_SIZE = 65536  # scripts.tok_train's --vocab-size in the speedrun


def profile_steps_flag(text: str) -> tuple[int, int]:
    try:
        return parse_profile_steps(text)
    except ProfileStepsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_profile_dir() -> str:
    return os.path.join(local_dir(), "profiles", "bench")


def print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    print(format_table(rows, columns))


def bench_loader(tokenizer, data_dir: str | None = None, *, seq_len: int = 2048, batch_size: int = 32,
                 grad_accum: int = 1, workers: int = 1, prefetch: int = 2, buffer_docs: int = 1000,
                 batches: int = 20, warmup: int = 2) -> dict:
    """Times `batches` batches after `warmup` (the first fills the document buffer). The loader runs
    flat out, so the rate is the producer's. cpu_cores is the process's CPU time over the wall time.

    Reading and tokenising is nearly all the work, so the CPU cost is counted per token read. The
    share cropped depends on the corpus (and on a small corpus, on how full of long documents the
    buffer has silted), so cores_for_target plans with FineWeb's: the cores to deliver
    TARGET_TOKENS_PER_S when FINEWEB_CROPPED_FRACTION of the tokens read are cropped away."""
    from jaxchat.data.loader import make_train_loader

    loader = make_train_loader(tokenizer, batch_size, seq_len, grad_accum, 0, 1, data_dir=data_dir,
                               buffer_docs=buffer_docs, workers=workers, prefetch=prefetch)
    start = time.perf_counter()
    next(loader)
    first_batch_s = time.perf_counter() - start
    for _ in range(warmup - 1):
        next(loader)
    before = loader.get_state()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(batches):
        inputs, _ = next(loader)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    state = loader.get_state()
    loader.close()

    # Restore cost: re-reading and re-tokenising the buffered documents, up to the next batch.
    resumed = make_train_loader(tokenizer, batch_size, seq_len, grad_accum, 0, 1, data_dir=data_dir,
                                buffer_docs=buffer_docs, workers=workers, prefetch=prefetch)
    restore_start = time.perf_counter()
    resumed.set_state(json.loads(json.dumps(state)))
    next(resumed)
    restore_s = time.perf_counter() - restore_start
    resumed.close()

    tokens = batches * inputs.size
    read = state["tokens_read"] - before["tokens_read"]
    packed = state["tokens_packed"] - before["tokens_packed"]
    cropped = state["tokens_cropped"] - before["tokens_cropped"]
    cpu_per_read_token = cpu / read
    return {
        "seq_len": seq_len, "batch_size": batch_size, "grad_accum": grad_accum, "workers": workers,
        "tokens_per_s": tokens / wall,
        "read_per_s": read / wall,
        "cropped_fraction": cropped / (packed + cropped),
        "cpu_cores": cpu / wall,
        "cpu_us_per_read_token": 1e6 * cpu_per_read_token,
        "cores_for_target": TARGET_TOKENS_PER_S / (1 - FINEWEB_CROPPED_FRACTION) * cpu_per_read_token,
        "first_batch_s": first_batch_s,
        "state_bytes": len(json.dumps(state, indent=4)),  # as grain's checkpoint handler writes it
        "buffered_row_groups": len(state["buffer"].split()),
        "restore_s": restore_s,
        "epoch": state["epoch"],
    }


def bench_checkpoint(*, depth: int, vocab_size: int, saves: int = 5, directory: str | None = None) -> list[dict]:
    """Saves of a train state (random values, so compression cannot shrink zeros) with async and
    blocking Orbax writes: the time save() holds the caller, and the time until the step is on disk."""
    import grain  # the data and checkpoint stack is imported only where it is measured

    from jaxchat.checkpoint.manager import RunCheckpoints

    run = build_run(RunSettings(depth=depth, num_iterations=100, device_batch_size=1, total_batch_size=2048,
                                num_devices=1), vocab_size)
    config, state = run.config, run.init_state()
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    noisy = lambda x: jax.random.normal(next(keys), x.shape, x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    params, opt_state = jax.tree.map(noisy, state.params), jax.tree.map(noisy, state.opt_state)
    data_iter = grain.MapDataset.range(10**6).batch(8).to_iter_dataset().__iter__()
    meta = {"val_bpb": None, "model_config": dataclasses.asdict(config), "user_config": {}, "device_batch_size": 1,
            "max_seq_len": config.sequence_len, "tokenizer": None,
            "loop_state": {"min_val_bpb": 1.0, "smooth_train_loss": 1.0, "total_training_time": 0.0}}
    results = []
    for async_save in (True, False):
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            blocked, complete = [], []
            with RunCheckpoints(tmp, async_save=async_save) as checkpointer:
                for step in range(saves + 1):  # the first save also sets Orbax up: left out
                    start = time.perf_counter()
                    checkpointer.save(step, params, opt_state, data_iter, meta)
                    returned = time.perf_counter()
                    checkpointer.wait()
                    blocked.append(returned - start)
                    complete.append(time.perf_counter() - start)
            on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(os.path.join(tmp, str(saves)))
                          for f in files)
        results.append({"config": f"d{depth} V{vocab_size}", "save": "async" if async_save else "blocking",
                        "blocked_ms": 1e3 * statistics.median(blocked[1:]),
                        "complete_ms": 1e3 * statistics.median(complete[1:]),
                        "state_mb": tree_nbytes(params, opt_state) / 1e6, "on_disk_mb": on_disk / 1e6})
    return results


def state_size(depth: int, vocab_size: int) -> dict:
    """Bytes of params and optimizer state of a model, from shapes alone (nothing allocated)."""
    state = build_run(RunSettings(depth=depth, num_iterations=100, device_batch_size=1, total_batch_size=2048,
                                  num_devices=1), vocab_size).state
    params, opt_state = state.params, state.opt_state
    return {"config": f"d{depth} V{vocab_size}", "params_gb": tree_nbytes(params) / 1e9,
            "optimizer_gb": tree_nbytes(opt_state) / 1e9, "total_gb": tree_nbytes(params, opt_state) / 1e9}


def bench_decode(*, depth: int, max_seq_len: int, vocab_size: int, tokens: int = 128,
                 samples: tuple[int, ...] = (1, 8)) -> list[dict]:
    """Greedy generation of `tokens` tokens after a short prompt: the engine (prefill once, one jitted
    decode step per token over the KV cache) against the full forward re-run on the padded sequence
    (one compilation) for each new token."""
    config = GPTConfig.from_depth(depth, vocab_size, max_seq_len=max_seq_len)
    model = GPT(config, rngs=nnx.Rngs(0))
    prompt = [0] + list(range(1, 9))  # token ids only: no tokenizer needed to time the maths
    engine = Engine(model, tokenizer=None, stop_tokens=set())  # no stop token: always `tokens` long
    graphdef, params = nnx.split(model)
    results = []
    for num_samples in samples:
        engine.generate_batch(prompt, num_samples=num_samples, max_tokens=tokens, temperature=0)  # compile
        start = time.perf_counter()
        engine.generate_batch(prompt, num_samples=num_samples, max_tokens=tokens, temperature=0)
        cached_s = time.perf_counter() - start
        full = jax.jit(lambda p, idx: nnx.merge(graphdef, p)(idx)).lower(
            params, jnp.zeros((num_samples, max_seq_len), jnp.int32)).compile()
        seq = np.zeros((num_samples, max_seq_len), np.int32)
        seq[:, :len(prompt)] = prompt
        start = time.perf_counter()
        for n in range(len(prompt), len(prompt) + tokens):
            seq[:, n] = np.asarray(jnp.argmax(full(params, seq)[:, n - 1], axis=-1))
        full_s = time.perf_counter() - start
        results.append({"config": f"d{depth} T{max_seq_len} V{vocab_size}", "samples": num_samples, "tokens": tokens,
                        "cache_tok_per_s": num_samples * tokens / cached_s,
                        "full_forward_tok_per_s": num_samples * tokens / full_s, "speedup": full_s / cached_s})
    return results


TRAIN_COLUMNS = [("config", "{}"), ("params", "{:,d}"), ("device", "{}"), ("compile_s", "{:.1f}"),
                 ("step_ms", "{:.1f}"), ("fwd_bwd_ms", "{:.1f}"), ("update_ms", "{:.1f}"), ("update_share", "{:.1%}"),
                 ("tok_per_s", "{:,.0f}"), ("model_tflops", "{:.4f}"), ("mfu", "{:.1%}"), ("mfu_against", "{}"),
                 ("xla_over_estimate", "{:.2f}"), ("polar_over_model", "{:.2e}"), ("peak_memory_gib", "{:.2f}"), ("memory_kind", "{}")]
CHECKPOINT_COLUMNS = [("config", "{}"), ("save", "{}"), ("blocked_ms", "{:,.0f}"), ("complete_ms", "{:,.0f}"),
                      ("state_mb", "{:,.1f}"), ("on_disk_mb", "{:,.1f}")]
SIZE_COLUMNS = [("config", "{}"), ("params_gb", "{:.3f}"), ("optimizer_gb", "{:.3f}"), ("total_gb", "{:.3f}")]
DECODE_COLUMNS = [("config", "{}"), ("samples", "{:d}"), ("tokens", "{:d}"), ("cache_tok_per_s", "{:,.1f}"),
                  ("full_forward_tok_per_s", "{:,.1f}"), ("speedup", "{:.1f}x")]
MEMORY_COLUMNS = [("what", "{}"), ("gib", "{:.2f}")]
KEPT_COLUMNS = [("dtype", "{}"), ("shape", "{}"), ("count", "{:d}"), ("gib", "{:.2f}"), ("source", "{}")]
LOWERED_COLUMNS = [("dtype", "{}"), ("shape", "{}"), ("count", "{:d}"), ("gib", "{:.3f}")]
COLLECTIVE_COLUMNS = [("kind", "{}"), ("count", "{:d}"), ("size_gib", "{:.3f}"), ("moved_gib", "{:.3f}")]
LOADER_COLUMNS = [("workers", "{:d}"), ("tokens_per_s", "{:,.0f}"), ("read_per_s", "{:,.0f}"),
                  ("cropped_fraction", "{:.1%}"), ("cpu_cores", "{:.2f}"), ("cpu_us_per_read_token", "{:.2f}"),
                  ("cores_for_target", "{:.1f}"), ("first_batch_s", "{:.2f}"), ("state_bytes", "{:,d}"),
                  ("buffered_row_groups", "{:d}"), ("restore_s", "{:.2f}"), ("epoch", "{:d}")]


def main_train(args: argparse.Namespace) -> list[dict]:
    results = []
    for pattern, depth, remat in itertools.product(args.window_pattern, args.depth, args.remat):
        settings = RunSettings(depth=depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                               max_seq_len=args.max_seq_len, window_pattern=pattern,
                               device_batch_size=args.device_batch_size, num_devices=args.num_devices, fsdp=args.fsdp,
                               attention=args.attention or DEFAULTS.attention, remat=remat)
        slug = f"d{depth}_{pattern}_{remat}"
        profiler = StepProfiler(args.profile_steps, os.path.join(args.profile_dir or default_profile_dir(), slug))
        results.append(time_train_step(settings, args.vocab_size, grad_accum=args.grad_accum, steps=args.steps,
                                       profiler=profiler))
        print(f"... {results[-1]['config']}: {results[-1]['step_ms']:.1f} ms/step", flush=True)
    print_table(results, TRAIN_COLUMNS)
    print("update_share: one optimizer update alone over the whole step. xla_over_estimate: XLA's FLOPs of "
          "forward+backward over estimate_flops x tokens. polar_over_model: Muon's Polar Express FLOPs over the "
          "model's FLOPs per step. mfu: model FLOP/s (estimate_flops) over the peak.")
    return results


def main_checkpoint(args: argparse.Namespace) -> list[dict]:
    results = bench_checkpoint(depth=args.depth, vocab_size=args.vocab_size, saves=args.saves, directory=args.dir)
    print_table(results, CHECKPOINT_COLUMNS)
    print("blocked_ms: the time save() holds the train loop (median); complete_ms: until the step is on disk.")
    sizes = [state_size(depth, vocab) for depth, vocab in ((args.depth, args.vocab_size), (20, 65536))]
    print_table(sizes, SIZE_COLUMNS)
    print("params and optimizer state in bytes, from eval_shape (what a checkpoint step holds before compression)")
    return results + sizes


def main_decode(args: argparse.Namespace) -> list[dict]:
    results = bench_decode(depth=args.depth, max_seq_len=args.max_seq_len, vocab_size=args.vocab_size,
                           tokens=args.tokens, samples=tuple(args.samples))
    print_table(results, DECODE_COLUMNS)
    print("cache: prefill once, then one jitted decode step per token; full forward: the whole padded sequence per token")
    return results


def main_loader(args: argparse.Namespace) -> list[dict]:
    from jaxchat import dataset
    from jaxchat.data import local_corpus
    from jaxchat.data.tokenizer import Tokenizer, TokenizerError, get_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        if args.builtin:
            documents = local_corpus.builtin_documents()
            paths = local_corpus.write_shards(lambda: documents, tmp, chars_per_shard=250_000,
                                              docs_per_row_group=16, source="builtin")
            train_texts = (text for path, row_group in dataset.list_row_groups("train", tmp)
                           for text in dataset.read_row_group(path, row_group))
            start = time.perf_counter()
            tokenizer = Tokenizer.train_from_iterator(train_texts, args.vocab_size)
            print(f"built-in corpus: {len(documents)} documents in {len(paths)} shards; tokenizer of "
                  f"{tokenizer.get_vocab_size()} tokens trained in {time.perf_counter() - start:.1f}s")
            data_dir = tmp
        else:
            try:
                tokenizer, data_dir = get_tokenizer(args.tokenizer_dir), args.data_dir
            except (FileNotFoundError, TokenizerError) as e:  # missing, or cut short
                fail(str(e))
        print(f"T={args.seq_len}, batch {args.grad_accum} x {args.batch_size} rows, buffer {args.buffer_docs} docs, "
              f"{args.batches} batches per setting, 1 process")
        results = [bench_loader(tokenizer, data_dir, seq_len=args.seq_len, batch_size=args.batch_size,
                                grad_accum=args.grad_accum, workers=workers, buffer_docs=args.buffer_docs,
                                batches=args.batches) for workers in args.workers]
    print_table(results, LOADER_COLUMNS)
    print(f"tokens_per_s: delivered in batches; read_per_s: read and tokenised. cores_for_target: CPU cores to "
          f"deliver {TARGET_TOKENS_PER_S:,.0f} tokens/s (d20 on 8 H100s, per host) at the measured CPU cost per token "
          f"read, with {FINEWEB_CROPPED_FRACTION:.0%} of tokens read cropped away (FineWeb at T=2048)")
    return results


def use_virtual_cpus(count: int) -> None:
    """The memory estimate runs on the CPU, on `count` virtual devices, whatever the machine has: both
    settings must be in place before JAX starts its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    jax.config.update("jax_platforms", "cpu")


def shape_text(shape) -> str:
    return "[" + ",".join(map(str, shape)) + "]"


def main_memory(args: argparse.Namespace) -> list[dict]:
    settings = RunSettings(depth=args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                           max_seq_len=args.max_seq_len, window_pattern=args.window_pattern,
                           device_batch_size=args.device_batch_size, fsdp=args.fsdp, remat=args.remat,
                           attention=args.attention)
    result = memory_estimate(settings, args.vocab_size, args.devices, device_gib=args.device_gb)
    print(result["config"] + " | per device, one micro-step per step, bf16 compute")
    for note in result["notes"]:
        print(note)
    print_table(result["per_device"], MEMORY_COLUMNS)
    print(f"against {result['device_gib']:.0f} GiB: {result['headroom_gib']:.1f} GiB to spare "
          f"({result['headroom_share']:.0%}); XLA's pool at the default memory fraction {GPU_MEMORY_FRACTION}: "
          f"{result['xla_share_gib']:.1f} GiB. XLA's own temporaries (workspace, fusion outputs) come on top.")
    print("\nlargest activations kept for the backward pass (same dtype, shape and source grouped):")
    print_table([{**g, "shape": shape_text(g["shape"])} for g in result["kept_largest"]], KEPT_COLUMNS)
    print("\nlargest tensor types in the step lowered for CUDA (one device's share; count: times written):")
    print_table([{**t, "shape": shape_text(t["shape"])} for t in result["lowered_largest"]], LOWERED_COLUMNS)
    flagged = result["float32_logits_sized"]
    print("float32 tensors of B x T x vocab elements or more in the lowered step: "
          + (", ".join(f"{t['dtype']}{shape_text(t['shape'])}" for t in flagged) if flagged else "none"))
    if "collectives" in result:
        print(f"\ncollectives of one step on {args.devices} devices ({result['collectives_source']}; "
              f"{SLICED_ALL_REDUCE}: an all-reduce sliced to 1/N, a reduce-scatter on GPUs):")
        print_table(result["collectives"], COLLECTIVE_COLUMNS)
        print(f"ZeRO-1 minimum (reduce-scatter of float32 gradients + all-gather of float32 parameters): "
              f"{result['zero1_minimum_gib']:.2f} GiB per device; this step moves {result['moved_over_minimum']:.2f}x that")
    return [result]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    sub = parser.add_subparsers(dest="what", required=True)
    train = sub.add_parser("train", help="the train step")
    train.add_argument("--depth", type=int, nargs="+", default=[4])
    train.add_argument("--aspect-ratio", type=int, default=DEFAULTS.aspect_ratio)
    train.add_argument("--head-dim", type=int, default=DEFAULTS.head_dim)
    train.add_argument("--max-seq-len", type=int, default=512)
    train.add_argument("--device-batch-size", type=int, default=4)
    train.add_argument("--grad-accum", type=int, default=1)
    train.add_argument("--vocab-size", type=int, default=8192)
    train.add_argument("--window-pattern", nargs="+", default=["SSSL"], help="one row per pattern (e.g. SSSL L)")
    train.add_argument("--num-devices", type=int, default=-1)
    train.add_argument("--fsdp", action="store_true")
    train.add_argument("--attention", choices=["cudnn", "splash", "xla"], default=None)
    train.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step")
    train.add_argument("--remat", nargs="+", choices=["auto", *REMAT_POLICIES], default=[DEFAULTS.remat],
                       help="one row per policy (default: scripts.train's)")
    train.add_argument("--profile-steps", type=profile_steps_flag, default=None, metavar="A:B",
                       help="after the timed steps, B-A more steps traced with jax.profiler as steps A..B-1, one "
                            "trace per row (jaxchat.train.profiling)")
    train.add_argument("--profile-dir", default=None, help="where the traces go (default: <base_dir>/profiles/bench)")
    checkpoint = sub.add_parser("checkpoint", help="async against blocking checkpoint saves; sizes")
    checkpoint.add_argument("--depth", type=int, default=4)
    checkpoint.add_argument("--vocab-size", type=int, default=8192)
    checkpoint.add_argument("--saves", type=int, default=5, help="timed saves of each kind")
    checkpoint.add_argument("--dir", default=None, help="where to write (default: the system's temp dir)")
    decode = sub.add_parser("decode", help="generation with the KV cache against the full forward")
    decode.add_argument("--depth", type=int, default=4)
    decode.add_argument("--max-seq-len", type=int, default=512)
    decode.add_argument("--vocab-size", type=int, default=8192)
    decode.add_argument("--tokens", type=int, default=128)
    decode.add_argument("--samples", type=int, nargs="+", default=[1, 8])
    loader = sub.add_parser("loader", help="the data loader")
    loader.add_argument("--builtin", action="store_true", help="bench on the built-in corpus with a tokenizer "
                        "trained on it (--vocab-size), all in a temporary directory")
    loader.add_argument("--vocab-size", type=int, default=8192, help="with --builtin (default 8192)")
    loader.add_argument("--data-dir", default=None, help="shards (default: <base_dir>/base_data)")
    loader.add_argument("--tokenizer-dir", default=None, help="tokenizer (default: <base_dir>/tokenizer)")
    loader.add_argument("--seq-len", type=int, default=2048)
    loader.add_argument("--batch-size", type=int, default=32, help="rows per micro-step on this process")
    loader.add_argument("--grad-accum", type=int, default=1)
    loader.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="tokeniser threads to try")
    loader.add_argument("--buffer-docs", type=int, default=1000)
    loader.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    memory = sub.add_parser("memory", help="what one device holds in a train step, and its collectives: from shapes")
    memory.add_argument("--depth", type=int, default=DEFAULTS.depth)
    memory.add_argument("--device-batch-size", type=int, default=DEFAULTS.device_batch_size)
    memory.add_argument("--max-seq-len", type=int, default=DEFAULTS.max_seq_len)
    memory.add_argument("--vocab-size", type=int, default=SPEEDRUN_VOCAB_SIZE)
    memory.add_argument("--aspect-ratio", type=int, default=DEFAULTS.aspect_ratio)
    memory.add_argument("--head-dim", type=int, default=DEFAULTS.head_dim)
    memory.add_argument("--window-pattern", default=DEFAULTS.window_pattern)
    memory.add_argument("--devices", type=int, default=1, help="devices of the data axis; >1 also compiles the step "
                        "on that many virtual CPU devices and lists its collectives")
    memory.add_argument("--fsdp", action="store_true")
    memory.add_argument("--remat", choices=list(REMAT_POLICIES), default="dots",
                        help="an explicit policy (scripts.train's default, auto, decides on the device itself)")
    memory.add_argument("--attention", choices=["cudnn", "xla"], default="cudnn")
    memory.add_argument("--device-gb", type=float, default=80.0, help="device memory to compare with, GiB")
    args = parser.parse_args(argv)
    if args.json:
        try:
            make_parent_dir(args.json)
        except OSError as e:
            fail(f"--json {args.json}: {e}")
    if args.what == "memory":
        use_virtual_cpus(args.devices)
    quiet_jax_warnings()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    if note := huge_pages_note():
        print(note)
    run = {"train": main_train, "checkpoint": main_checkpoint, "decode": main_decode, "loader": main_loader,
           "memory": main_memory}
    results = run[args.what](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
