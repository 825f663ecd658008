"""
Benchmarks that print a table (and can write JSON). Speed is measured here, never in tests.

  python -m scripts.bench train --depth 4 --max-seq-len 512 --device-batch-size 4 --vocab-size 8192
  python -m scripts.bench train --depth 12 --window-pattern SSSL L          # one row per pattern
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
import collections
import contextlib
import itertools
import dataclasses
import json
import math
import os
import re
import resource
import statistics
import tempfile
import time


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxchat.common import peak_flops_per_device, quiet_jax_warnings, tree_nbytes
from jaxchat.engine import Engine
from jaxchat.gpt import GPT, REMAT_POLICIES, GPTConfig, estimate_flops
from jaxchat.mesh import batch_sharding, make_mesh, put_batch
from jaxchat.muon import polar_express_flops
from jaxchat.run import RunSettings, abstract_batch, build_run
from jaxchat.runtime import GPU_MEMORY_FRACTION
from jaxchat.trainer import abstract_model

TARGET_TOKENS_PER_S = 1e6  # what a d20 run on 8 H100s consumes per host
FINEWEB_CROPPED_FRACTION = 0.35  # nanochat's figure for best-fit packing at T=2048 on FineWeb-Edu


def print_table(results: list[dict], columns: list[tuple[str, str]]) -> None:
    cells = [[fmt.format(r[name]) if r.get(name) is not None else "n/a" for name, fmt in columns] for r in results]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _) in enumerate(columns)]
    print("  ".join(name.rjust(w) for (name, _), w in zip(columns, widths)))
    for row in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


def timed(fn, *args, repeats: int) -> float:
    """Seconds per call of an already compiled fn, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # a list in older JAX versions
    return float(cost.get("flops", 0.0))


def cpu_matmul_flops_per_s(n: int = 1024, repeats: int = 20) -> float:
    """float32 matmul rate of one CPU device: the denominator of MFU where no peak is published."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x).lower(a).compile()
    return 2 * n**3 / timed(matmul, a, repeats=repeats)


def peak_memory_bytes(devices) -> tuple[int, str]:
    """Peak device memory if the backend reports it, else the process's peak resident host memory."""
    stats = [d.memory_stats() or {} for d in devices]
    peak = max((s.get("peak_bytes_in_use", 0) for s in stats), default=0)
    if peak:
        return peak, "device"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"


def bench_train(*, depth: int, aspect_ratio: int = 64, head_dim: int = 128, max_seq_len: int = 2048,
                device_batch_size: int = 32, grad_accum: int = 1, vocab_size: int = 65536,
                window_pattern: str = "SSSL", num_devices: int = -1, fsdp: bool = False, steps: int = 10,
                attention: str | None = None, remat: str = RunSettings.remat, breakdown: bool = True) -> dict:
    """The train step that scripts.train builds for these flags (jaxchat.run), on random tokens.
    breakdown=False leaves out forward+backward alone and the update alone (two more compilations)."""
    mesh = make_mesh(num_devices)
    world = mesh.devices.size
    tokens_per_step = grad_accum * device_batch_size * world * max_seq_len
    settings = RunSettings(depth=depth, aspect_ratio=aspect_ratio, head_dim=head_dim, max_seq_len=max_seq_len,
                           window_pattern=window_pattern, num_iterations=1000, device_batch_size=device_batch_size,
                           total_batch_size=tokens_per_step, num_devices=world, fsdp=fsdp,
                           attention=attention or "auto", remat=remat)
    run = build_run(settings, vocab_size, mesh=mesh)
    config, optimizer, state = run.config, run.optimizer, run.init_state()
    rng = np.random.default_rng(0)
    shape = (grad_accum, device_batch_size * world, max_seq_len)
    spec = batch_sharding(mesh)
    inputs = put_batch(rng.integers(0, vocab_size, shape, dtype=np.int32), spec)
    targets = put_batch(rng.integers(0, vocab_size, shape, dtype=np.int32), spec)

    # the whole train step, compiled once, as scripts.train runs it
    start = time.perf_counter()
    step = run.train_step().lower(state.params, state.opt_state, inputs, targets).compile()
    compile_s = time.perf_counter() - start
    params, opt_state = state.params, state.opt_state
    params, opt_state, metrics = step(params, opt_state, inputs, targets)  # warm-up
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, inputs, targets)
    jax.block_until_ready((params, opt_state, metrics))
    step_s = (time.perf_counter() - start) / steps

    # forward+backward of one micro-batch alone, and one optimizer update alone
    flops_per_token = estimate_flops(config)
    micro_tokens = device_batch_size * world * max_seq_len
    fwd_bwd_s = update_s = xla_over_estimate = None
    if breakdown:
        graphdef = state.graphdef

        def loss_fn(p, x, y):
            return nnx.merge(graphdef, p)(x, y)

        fwd_bwd = jax.jit(jax.value_and_grad(loss_fn)).lower(params, inputs[0], targets[0]).compile()
        fwd_bwd_s = timed(fwd_bwd, params, inputs[0], targets[0], repeats=steps)
        _, grads = fwd_bwd(params, inputs[0], targets[0])
        update = jax.jit(optimizer.update).lower(grads, opt_state, params).compile()
        update_s = timed(update, grads, opt_state, params, repeats=steps)
        xla_over_estimate = xla_flops(fwd_bwd) * world / (flops_per_token * micro_tokens)

    tok_per_s = tokens_per_step / step_s
    model_flops_per_s = flops_per_token * tok_per_s
    device = mesh.devices.flat[0]
    peak = peak_flops_per_device(device)
    peak_kind = "bf16 peak"
    if peak is None and device.platform == "cpu":
        peak, peak_kind = cpu_matmul_flops_per_s(), "f32 matmul"
    memory, memory_kind = peak_memory_bytes(jax.local_devices())
    return {
        "config": f"d{depth} T{max_seq_len} B{device_batch_size}x{world}x{grad_accum} V{vocab_size} {window_pattern} remat={remat}"
                  + (" fsdp" if fsdp else ""),
        "params": sum(x.size for x in jax.tree.leaves(params)),
        "device": f"{world}x {device.device_kind}",
        "compile_s": compile_s,
        "step_ms": 1e3 * step_s,
        "fwd_bwd_ms": 1e3 * fwd_bwd_s if breakdown else None,
        "update_ms": 1e3 * update_s if breakdown else None,
        "update_share": update_s / step_s if breakdown else None,
        "tok_per_s": tok_per_s,
        "model_tflops": model_flops_per_s / 1e12,
        "mfu": model_flops_per_s / (peak * world) if peak else None,
        "mfu_against": peak_kind if peak else None,
        "xla_over_estimate": xla_over_estimate,
        # Polar Express costs the same whatever the batch: against the model's FLOPs of one whole step
        "polar_over_model": polar_express_flops(
            [x.shape for x in jax.tree.leaves(params["blocks"])]) / (flops_per_token * tokens_per_step),
        "peak_memory_gib": memory / 2**30,
        "memory_kind": memory_kind,
    }


def bench_loader(tokenizer, data_dir: str | None = None, *, seq_len: int = 2048, batch_size: int = 32,
                 grad_accum: int = 1, workers: int = 1, prefetch: int = 2, buffer_docs: int = 1000,
                 batches: int = 20, warmup: int = 2) -> dict:
    """Times `batches` batches after `warmup` (the first fills the document buffer). The loader runs
    flat out, so the rate is the producer's. cpu_cores is the process's CPU time over the wall time.

    Reading and tokenising is nearly all the work, so the CPU cost is counted per token read. The
    share cropped depends on the corpus (and on a small corpus, on how full of long documents the
    buffer has silted), so cores_for_target plans with FineWeb's: the cores to deliver
    TARGET_TOKENS_PER_S when FINEWEB_CROPPED_FRACTION of the tokens read are cropped away."""
    from jaxchat.dataloader import make_train_loader

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

    from jaxchat.checkpoint import RunCheckpoints

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


# ---- memory and communication of a train step, from shapes alone ---------------------------------
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
SLICED_ALL_REDUCE = "reduce-scatter*"  # an all-reduce each device slices to its 1/N: XLA:GPU makes it a reduce-scatter
ASSUMED_CUDNN_VERSION = 91000  # cuDNN 9.10: past every version check of the attention gate
ASSUMED_COMPUTE_CAPABILITY = (9, 0)  # H100


def dtype_bytes(name: str) -> int:
    """Bytes per element of an HLO or StableHLO element type (f32, bf16, s32, i1, pred, f8e4m3fn, ...)."""
    if name in ("pred", "i1"):
        return 1
    digits = re.search(r"\d+", name)
    return max(1, int(digits.group()) // 8) if digits else 0  # no digits: token, opaque


@contextlib.contextmanager
def cudnn_without_gpu():
    """Let jax.nn.dot_product_attention(implementation='cudnn') trace and lower for CUDA where there is
    no cuDNN: its version gate asks the installed cuDNN and the GPU's compute capability, so answer as
    cuDNN 9.10 on an H100 would, inside this block only. Yields 'real' (a cuDNN answers: nothing
    changed), 'assumed' (the gate answered as above) or 'unavailable' (this JAX keeps its gate
    elsewhere: cuDNN attention cannot be traced here). Only shapes and lowered programs come out of
    such a block: nothing runs."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fused

        saved = fused.check_cudnn_version, fused.check_compute_capability
    except (ImportError, AttributeError):
        fused = None
    if fused is None:
        yield "unavailable"
        return
    try:
        fused.check_cudnn_version()
        present = True
    except RuntimeError:  # "cuDNN is not detected"
        present = False
    if present:
        yield "real"
        return
    fused.check_cudnn_version = lambda: ASSUMED_CUDNN_VERSION
    fused.check_compute_capability = lambda capability: tuple(map(int, capability.split("."))) <= ASSUMED_COMPUTE_CAPABILITY
    try:
        yield "assumed"
    finally:
        fused.check_cudnn_version, fused.check_compute_capability = saved


def kept_activations(fn, *args) -> list[dict]:
    """What the backward pass of fn keeps from its forward pass (JAX's saved residuals), largest first,
    less fn's arguments themselves (parameters and batch exist anyway). Each: bytes, dtype, shape, source."""
    from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals, which prints the list

    kept = []
    for aval, source in saved_residuals(fn, *args):
        if source.startswith("from the argument"):
            continue
        source = re.sub(r"\S*/([\w.]+\.py)", r"\1", source)  # file names without their directories
        kept.append({"bytes": math.prod(aval.shape) * aval.dtype.itemsize, "dtype": str(aval.dtype),
                     "shape": tuple(aval.shape), "source": source})
    return sorted(kept, key=lambda r: -r["bytes"])


def group_kept(kept: list[dict], top: int) -> list[dict]:
    """Kept arrays of the same dtype, shape and source (one per layer, typically) as one row with a
    count and their total bytes; the `top` largest totals."""
    groups = {}
    for row in kept:
        group = groups.setdefault((row["dtype"], row["shape"], row["source"]), {**row, "count": 0, "total_bytes": 0})
        group["count"] += 1
        group["total_bytes"] += row["bytes"]
    return sorted(groups.values(), key=lambda g: -g["total_bytes"])[:top]


def stablehlo_tensors(text: str) -> list[dict]:
    """Every distinct tensor type in StableHLO text (tensor<32x2048x1280xbf16>) with how often it is
    written: bytes (of one), dtype, shape, count."""
    counts = collections.Counter(re.findall(r"tensor<((?:\d+x)*)([a-zA-Z]\w*)>", text))
    return [{"bytes": math.prod(shape) * dtype_bytes(dtype), "dtype": dtype, "shape": shape, "count": count}
            for (dims, dtype), count in counts.items() for shape in [tuple(int(d) for d in dims.split("x") if d)]]


@dataclasses.dataclass
class HloInstruction:
    opcode: str
    arrays: list[tuple[str, tuple[int, ...]]]  # (dtype, shape) of each array in the result type
    operands: list[str]
    attributes: str

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.arrays)


def parse_hlo(text: str) -> dict[str, HloInstruction]:
    """The instructions of HLO text by name (names are unique across the module's computations)."""
    instructions = {}
    for match in re.finditer(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$", text, re.MULTILINE):
        name, result_type, opcode, rest = match.groups()
        depth, end = 1, len(rest)
        for i, char in enumerate(rest):  # the operand list ends at the matching parenthesis
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                end = i
                break
        arrays = [(dtype, tuple(int(d) for d in dims.split(",") if d))
                  for dtype, dims in re.findall(r"([a-z][a-z0-9]*)\[([\d,]*)\]", result_type)]
        instructions[name] = HloInstruction(opcode, arrays, re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1:])
    return instructions


def replica_group_size(attributes: str, num_devices: int) -> int:
    """Devices in each replica group: {{0,1,2,3},{4,5,6,7}}, the iota form [2,4]<=[8], or the mesh form
    mesh['axis_0'=8,'axis_1'=1] {'axis_0'}; no groups ({}) means all devices."""
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", attributes):
        return len(m.group(1).split(","))
    if m := re.search(r"replica_groups=\[\d+,(\d+)\]<=", attributes):
        return int(m.group(1))
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes):
        sizes = {axis: int(size) for axis, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[axis] for axis in re.findall(r"'(\w+)'", m.group(2)))
    return num_devices


def _sliced_to_shards(name: str, numel: int, group: int, instructions: dict, users: dict) -> bool:
    """Whether every use of a value takes a 1/group slice of it (through reshapes, copies and converts)."""
    uses = users.get(name, [])
    for user in uses:
        inst = instructions[user]
        if inst.opcode == "dynamic-slice" and inst.numel * group == numel:
            continue
        if inst.opcode in ("bitcast", "reshape", "copy", "transpose", "convert") and inst.numel == numel \
                and _sliced_to_shards(user, numel, group, instructions, users):
            continue
        return False
    return bool(uses)


def hlo_collectives(text: str, num_devices: int) -> list[dict]:
    """The collectives in HLO text, each with its kind, group size n, size in bytes and the bytes it
    moves per device, by the ring convention:
      all-reduce          2(n-1)/n x size      (size: the reduced array)
      reduce-scatter      (n-1)/n x full size  (full size: the array before scattering)
      all-gather          (n-1)/n x full size  (full size: the gathered array)
      all-to-all          (n-1)/n x size
      collective-permute  size
    An async pair (all-reduce-start/-done, ...) counts once, by its -start; reduce-scatters and
    all-to-alls that XLA wraps in async-start keep their plain op in the wrapped computation.
    An all-reduce of which each device only uses its 1/n slice (how the SPMD partitioner writes a
    reduce-scatter, before XLA:GPU's reduce-scatter creator rewrites it) counts as a reduce-scatter,
    kind SLICED_ALL_REDUCE. A collective inside a loop body counts once, whatever the trip count."""
    instructions = parse_hlo(text)
    users = collections.defaultdict(list)
    for name, inst in instructions.items():
        for operand in set(inst.operands):
            users[operand].append(name)
    found = []
    for name, inst in instructions.items():
        kind = inst.opcode.removesuffix("-start")
        if kind not in COLLECTIVE_KINDS:
            continue
        arrays = inst.arrays
        if inst.opcode == "all-gather-start":  # result: (operands, gathered)
            arrays = arrays[len(arrays) // 2:]
        elif inst.opcode == "collective-permute-start":  # result: (operand, output, contexts)
            arrays = arrays[1:2]
        size = sum(math.prod(shape) * dtype_bytes(dtype) for dtype, shape in arrays)
        n = 1 if kind == "collective-permute" else replica_group_size(inst.attributes, num_devices)
        if kind == "all-reduce" and inst.opcode == "all-reduce" and n > 1:
            if len(arrays) == 1:
                parts = [(name, inst.numel)]
            else:  # a tuple: its parts are used through get-tuple-element
                parts = [(user, instructions[user].numel) for user in users.get(name, [])]
            if parts and all(_sliced_to_shards(part, numel, n, instructions, users) for part, numel in parts):
                kind = SLICED_ALL_REDUCE
        factor = {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(kind, (n - 1) / n)
        if kind == "reduce-scatter":  # the result is one shard: the full size is n times it
            size *= n
        found.append({"name": name, "kind": kind, "group": n, "bytes": size, "moved": factor * size})
    return found


def collective_summary(found: list[dict]) -> list[dict]:
    """Count, size and bytes moved per device, per kind of collective, and in all."""
    rows = []
    for kind in (*COLLECTIVE_KINDS[:2], SLICED_ALL_REDUCE, *COLLECTIVE_KINDS[2:]):
        of_kind = [c for c in found if c["kind"] == kind]
        if of_kind:
            rows.append({"kind": kind, "count": len(of_kind), "size_gib": sum(c["bytes"] for c in of_kind) / 2**30,
                         "moved_gib": sum(c["moved"] for c in of_kind) / 2**30})
    rows.append({"kind": "all", "count": len(found), "size_gib": sum(r["size_gib"] for r in rows),
                 "moved_gib": sum(r["moved_gib"] for r in rows)})
    return rows


def partitioned_hlo(lowered) -> tuple[str, str]:
    """Compile a lowered step and return (HLO text, what it is): the module right after XLA's SPMD
    partitioner, where the collectives are as the program asks for them -- XLA:CPU's later passes run
    bf16 all-reduces in float32 and leave reduce-scatters as all-reduce + slice, which XLA:GPU does
    not --, or the optimised module where this XLA names its passes otherwise."""
    with tempfile.TemporaryDirectory() as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump, "xla_dump_hlo_pass_re": "spmd-partitioning"})
        dumped = sorted(name for name in os.listdir(dump) if "after_spmd-partitioning" in name)
        if dumped:
            with open(os.path.join(dump, dumped[-1])) as f:
                return f.read(), "after SPMD partitioning"
    return compiled.as_text(), "XLA:CPU's optimised module"


def per_device_bytes(tree, shardings) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs laid out by these shardings."""
    sizes = jax.tree.map(lambda x, s: math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize, tree, shardings)
    return sum(jax.tree.leaves(sizes))


def with_shardings(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_step(settings: RunSettings, vocab_size: int, mesh):
    """The run of these settings (one micro-step per step), its jitted step and the step's abstract
    arguments (ShapeDtypeStructs carrying their shardings)."""
    world = mesh.devices.size
    settings = dataclasses.replace(settings, num_iterations=1000, num_devices=world,
                                   total_batch_size=settings.device_batch_size * settings.max_seq_len * world)
    run = build_run(settings, vocab_size, mesh=mesh)
    args = (with_shardings(run.state.params, run.state.param_shardings),
            with_shardings(run.state.opt_state, run.state.opt_shardings), *abstract_batch(run))
    return run, run.train_step(), args


def bench_memory(*, depth: int, device_batch_size: int, max_seq_len: int = 2048, vocab_size: int = 65536,
                 aspect_ratio: int = 64, head_dim: int = 128, window_pattern: str = "SSSL", num_devices: int = 1,
                 fsdp: bool = False, remat: str = RunSettings.remat, attention: str = "cudnn", device_gib: float = 80.0,
                 top: int = 10) -> dict:
    """What one device holds during a train step, from abstract shapes (nothing is allocated): parameters,
    optimizer state and gradients in their shardings over num_devices, the activations the backward
    pass keeps for one device's micro-batch (bf16 compute, as on a GPU), the largest tensors of the step
    lowered for CUDA, and, on several devices, the collectives of the step compiled on virtual CPU devices."""
    notes = []
    with cudnn_without_gpu() as gate:
        if attention == "cudnn" and gate == "assumed":
            major, minor = divmod(ASSUMED_CUDNN_VERSION // 100, 100)
            notes.append(f"cuDNN attention traced and lowered past its version gate (no cuDNN here): cuDNN "
                         f"{major}.{minor} on compute capability {'.'.join(map(str, ASSUMED_COMPUTE_CAPABILITY))} assumed")
        elif attention == "cudnn" and gate == "unavailable":
            attention = "xla"
            notes.append("cuDNN attention cannot be traced without cuDNN in this JAX version: estimated with the "
                         "XLA attention path (it keeps the T x T scores: more than cuDNN would)")
        settings = RunSettings(depth=depth, aspect_ratio=aspect_ratio, head_dim=head_dim, max_seq_len=max_seq_len,
                               window_pattern=window_pattern, device_batch_size=device_batch_size, fsdp=fsdp,
                               remat=remat, attention=attention, compute_dtype="bfloat16")
        # parameters, optimizer state, gradients: what the shardings over num_devices give one device
        mesh = make_mesh(num_devices)
        run, _, _ = abstract_step(settings, vocab_size, mesh)
        config, state = run.config, run.state
        params = per_device_bytes(state.params, state.param_shardings)
        optimizer = per_device_bytes(state.opt_state, state.opt_shardings)
        # make_train_step's float32 accumulator: the parameters' layout with FSDP, whole on each device with ZeRO-1
        # (it is reduce-scattered once per step); one micro-step's gradients at most as much again
        f32_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), state.params)
        grad_sum = per_device_bytes(f32_params, state.param_shardings)
        micro_grads = grad_sum

        # the activations kept for the backward pass of one device's micro-batch
        graphdef, abstract_params = nnx.split(abstract_model(config, **settings.model_kwargs()))
        tokens = jax.ShapeDtypeStruct((device_batch_size, max_seq_len), jnp.int32)
        kept = kept_activations(lambda p, x, y: nnx.merge(graphdef, p)(x, y), abstract_params, tokens, tokens)
        activations = sum(r["bytes"] for r in kept)

        # the step of one device's share, lowered for CUDA: its largest tensors
        _, step, args = abstract_step(settings, vocab_size, make_mesh(1))
        text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    lowered = stablehlo_tensors(text)
    # float32 logits of the whole micro-batch, in any layout: a vocabulary dimension and B x T x vocab elements
    logits_numel = device_batch_size * max_seq_len * vocab_size
    full_logits = [t for t in lowered if t["dtype"] == "f32" and math.prod(t["shape"]) >= logits_numel
                   and {vocab_size, config.padded_vocab_size} & set(t["shape"])]

    total = params + optimizer + grad_sum + micro_grads + activations
    gib = 2**30
    budget = [{"what": what, "gib": value / gib} for what, value in (
        ("parameters", params), ("optimizer state", optimizer), ("gradient accumulator", grad_sum),
        ("micro-step gradients (upper bound)", micro_grads), ("kept activations", activations), ("total", total))]
    result = {
        "config": f"d{depth} T{max_seq_len} B{device_batch_size} V{vocab_size} {window_pattern} x{num_devices}"
                  + (" fsdp" if fsdp else "") + f" remat={remat} attention={attention}",
        "per_device": budget, "device_gib": device_gib, "headroom_gib": device_gib - total / gib,
        "headroom_share": 1 - total / gib / device_gib,
        "xla_share_gib": float(GPU_MEMORY_FRACTION) * device_gib,
        "kept_largest": [{**g, "shape": list(g["shape"]), "gib": g["total_bytes"] / gib} for g in group_kept(kept, top)],
        "lowered_largest": [{**t, "shape": list(t["shape"]), "gib": t["bytes"] / gib}
                            for t in sorted(lowered, key=lambda t: -t["bytes"])[:top]],
        "float32_logits_sized": [{**t, "shape": list(t["shape"])} for t in full_logits],
        "notes": notes,
    }
    if num_devices > 1:
        # collectives: the step compiled on num_devices CPU devices (cuDNN attention cannot compile on a
        # CPU; attention has no collectives in this layout, so the XLA path stands in for it)
        _, step, args = abstract_step(dataclasses.replace(settings, attention="xla"), vocab_size, mesh)
        hlo, source = partitioned_hlo(step.trace(*args).lower())
        found = hlo_collectives(hlo, num_devices)
        num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
        # ZeRO-1's minimum: reduce-scatter the float32 gradients once, all-gather the float32 parameters once
        minimum = 2 * (num_devices - 1) / num_devices * 4 * num_params
        summary = collective_summary(found)
        result.update(collectives=summary, collectives_source=source, zero1_minimum_gib=minimum / gib,
                      moved_over_minimum=summary[-1]["moved_gib"] * gib / minimum)
    return result


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
        results.append(bench_train(
            depth=depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim, max_seq_len=args.max_seq_len,
            device_batch_size=args.device_batch_size, grad_accum=args.grad_accum, vocab_size=args.vocab_size,
            window_pattern=pattern, num_devices=args.num_devices, fsdp=args.fsdp, steps=args.steps,
            attention=args.attention, remat=remat))
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
    from jaxchat import dataset, local_corpus
    from jaxchat.tokenizer import Tokenizer, get_tokenizer

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
            tokenizer, data_dir = get_tokenizer(args.tokenizer_dir), args.data_dir
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
    result = bench_memory(depth=args.depth, device_batch_size=args.device_batch_size, max_seq_len=args.max_seq_len,
                          vocab_size=args.vocab_size, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim,
                          window_pattern=args.window_pattern, num_devices=args.devices, fsdp=args.fsdp,
                          remat=args.remat, attention=args.attention, device_gib=args.device_gb)
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
    train.add_argument("--aspect-ratio", type=int, default=64)
    train.add_argument("--head-dim", type=int, default=128)
    train.add_argument("--max-seq-len", type=int, default=512)
    train.add_argument("--device-batch-size", type=int, default=4)
    train.add_argument("--grad-accum", type=int, default=1)
    train.add_argument("--vocab-size", type=int, default=8192)
    train.add_argument("--window-pattern", nargs="+", default=["SSSL"], help="one row per pattern (e.g. SSSL L)")
    train.add_argument("--num-devices", type=int, default=-1)
    train.add_argument("--fsdp", action="store_true")
    train.add_argument("--attention", choices=["cudnn", "xla"], default=None)
    train.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step")
    train.add_argument("--remat", nargs="+", choices=list(REMAT_POLICIES), default=[RunSettings.remat],
                       help="one row per policy (default: scripts.train's)")
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
    memory.add_argument("--depth", type=int, default=20)
    memory.add_argument("--device-batch-size", type=int, default=32)
    memory.add_argument("--max-seq-len", type=int, default=2048)
    memory.add_argument("--vocab-size", type=int, default=65536)
    memory.add_argument("--aspect-ratio", type=int, default=64)
    memory.add_argument("--head-dim", type=int, default=128)
    memory.add_argument("--window-pattern", default="SSSL")
    memory.add_argument("--devices", type=int, default=1, help="devices of the data axis; >1 also compiles the step "
                        "on that many virtual CPU devices and lists its collectives")
    memory.add_argument("--fsdp", action="store_true")
    memory.add_argument("--remat", choices=list(REMAT_POLICIES), default=RunSettings.remat, help="(default: scripts.train's)")
    memory.add_argument("--attention", choices=["cudnn", "xla"], default="cudnn")
    memory.add_argument("--device-gb", type=float, default=80.0, help="device memory to compare with, GiB")
    args = parser.parse_args(argv)
    if args.what == "memory":
        use_virtual_cpus(args.devices)
    quiet_jax_warnings()
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    run = {"train": main_train, "checkpoint": main_checkpoint, "decode": main_decode, "loader": main_loader,
           "memory": main_memory}
    results = run[args.what](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
