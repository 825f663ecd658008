"""
The checks and figures that need an NVIDIA GPU, in one call that survives its first run on a machine
lent for a few minutes:

    python -m scripts.gpu_check --json $OUT/gpu.json --budget-s 480

and, with no GPU at all (the `cuda12` extra installed, JAX_PLATFORMS=cpu), the real train step compiled
for 1 and 8 H100s (jaxchat.compiled.compile_only): peak memory per device and its parts, cuDNN attention calls
with their windows, GEMMs by library (fp8 apart), collectives with the bytes each device moves, compile
time; exit 1 if the step does not compile or its peak is above XLA's pool:

    python -m scripts.gpu_check --compile-only [--devices 1 8] [--depth 20 --device-batch-size 32 ...]

and the same for a TPU slice (the `tpu` extra: libtpu; splash attention's kernels, peak against the chip's HBM,
and XLA:TPU's predicted step time, tokens/s per chip and MFU, from its cost model: jaxchat.compiled.tpu_cost):

    JAX_PLATFORMS=cpu python -m scripts.gpu_check --compile-only --target v6e:2x4 [--depth 20 --device-batch-size 16 ...]

Every flag of scripts.train (jaxchat.train.settings) is a flag of --compile-only (--remat, --window-pattern, ...).
The report (JSON) and the optimised HLO files beside it go to --json, by default under
<base_dir>/gpu_check/: gpu_check.json, or compile_only_<target>.json (compile_only_h100.json,
compile_only_v6e-2x4.json), so that one target's files never replace another's.

Each measurement runs in a process of its own, in this order (the first answers whether d20 fits):
  environment   JAX, jaxlib, the devices and their memory, the XLA flags in effect
  memory_d20    compile only: XLA's memory analysis of the d20 train step at device batch 32 on this
                GPU, and the same scaled to 8 devices (ZeRO-1) against an 80 GB H100; the optimised
                HLO of the step is written next to the JSON (<json>.d20_step.hlo.txt.gz)
  step_d20      the d20 train step: tok/s, MFU, peak memory
  windows_d12   the d12 train step with window pattern SSSL and with L: what the short windows save
  attention     cuDNN flash attention against the XLA path (outputs, gradients; windowed, full, GQA),
                and attention with window T/2 against T
  flags_off     the d12 SSSL step without jaxchat's GPU runtime defaults (jaxchat.distributed.runtime), against
                windows_d12's SSSL row, which ran with them
After each one the whole report is rewritten to --json, so a run cut short still leaves what it
measured. A measurement that fails (an exception, a crash, out of memory, past the time left) is
recorded with its error and the next one runs. --budget-s: each measurement has a cost estimated up
front (compilations included); one that will not fit in the time left is skipped and recorded so.
The exit status is 1 if a measurement failed (or cuDNN disagrees with XLA), else 0.

Without a GPU it refuses (exit 2) unless --allow-cpu, which runs the d2 versions of the same
measurements on the CPU in seconds (the cuDNN one fails there, and is recorded as failed): what the
tests run. Needs only jax, flax and optax (no grain, tokenizer or data).
"""

import argparse
import dataclasses
import datetime
import gzip
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 2e-2  # relative to the output scale: a few bf16 ulps accumulated over the softmax
ZERO1_DEVICES = 8  # one host of nanochat's speedrun
ENVIRONMENT_TIMEOUT_S = 120  # starting JAX on a busy or cold machine, whatever the budget
SPEEDRUN_VOCAB_SIZE = 65536  # scripts.tok_train's --vocab-size in the speedrun


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The models the measurements use: nanochat's on a GPU, d2 on a CPU (every path, in seconds)."""

    big: dict  # the d20 step: depth, max_seq_len, vocab_size, device_batch_size
    small: dict  # the d12 step
    attention: list[tuple]  # (batch, T, heads, kv heads, head dim, window): sliding, full, GQA, odd sizes
    window: tuple  # (batch, T, heads, head dim) of the window T/2 against T timing


def device_batch_size(args: argparse.Namespace) -> int:
    """--device-batch-size as given, else the settings' default (the settings' flags are SUPPRESSed)."""
    from jaxchat.train.settings import RunSettings

    return getattr(args, "device_batch_size", RunSettings.device_batch_size)


def sizes(cpu: bool, device_batch_size: int) -> Sizes:
    if cpu:
        tiny = dict(depth=2, max_seq_len=256, vocab_size=1024, device_batch_size=2)  # T above the loss chunk
        return Sizes(big=tiny, small=tiny, attention=[(1, 128, 2, 2, 64, 32)], window=(1, 128, 2, 64))
    return Sizes(big=dict(depth=20, max_seq_len=2048, vocab_size=SPEEDRUN_VOCAB_SIZE, device_batch_size=device_batch_size),
                 small=dict(depth=12, max_seq_len=2048, vocab_size=SPEEDRUN_VOCAB_SIZE, device_batch_size=device_batch_size),
                 attention=[(2, 2048, 10, 10, 128, 1024), (2, 2048, 10, 10, 128, 2048), (2, 2048, 8, 2, 128, 1024),
                            (2, 1000, 6, 6, 64, 300)],
                 window=(16, 2048, 10, 128))


# ---- the measurements (each runs in a child process) -----------------------------------------------
def check_environment(args, size: Sizes) -> dict:
    import jax

    from jaxchat.distributed.runtime import MEM_FRACTION_ENV

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    try:
        from jax._src.lib import cuda_versions

        cudnn = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # noqa: BLE001 -- a version to report, nothing depends on it
        cudnn = None
    return {"jax": jax.__version__, "backend": jax.default_backend(), "devices": jax.device_count(),
            "device_kind": device.device_kind, "bytes_limit": stats.get("bytes_limit"), "cudnn": cudnn,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "mem_fraction": os.environ.get(MEM_FRACTION_ENV),
            "summary": f"jax {jax.__version__}, {jax.device_count()} x {device.device_kind}, backend {jax.default_backend()}"}


def check_memory(args, sizes: Sizes) -> dict:
    """Compile only: the fit answer. XLA's memory analysis of the step on this one device (all of the
    optimizer state), then less 7/8 of the optimizer state, which
    ZeRO-1 over 8 devices leaves each device 1/8 of, against an H100's pool at the memory fraction."""
    import jax

    from jaxchat.common import tree_nbytes
    from jaxchat.compiled.compile_only import abstract_step, target_pool_bytes
    from jaxchat.compiled.remat_choice import compiled_peak_bytes
    from jaxchat.compiled.hlo import parse_hlo
    from jaxchat.distributed.mesh import make_mesh
    from jaxchat.train.run import RunSettings

    size = sizes.big

    settings = RunSettings(depth=size["depth"], max_seq_len=size["max_seq_len"], device_batch_size=size["device_batch_size"])
    run, step, step_args = abstract_step(settings, size["vocab_size"], make_mesh(1))
    state = run.state
    start = time.perf_counter()
    compiled = step.trace(*step_args).lower().compile()
    compile_s = time.perf_counter() - start
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError("this backend gives no memory analysis")
    needed = compiled_peak_bytes(compiled)
    shrinks = (1 - 1 / ZERO1_DEVICES) * tree_nbytes(state.opt_state)  # the gradient accumulator stays whole
    on_8 = needed - shrinks
    h100_pool = target_pool_bytes()
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")

    hlo = compiled.as_text()
    hlo_path = f"{os.path.splitext(args.json)[0]}.d{size['depth']}_step.hlo.txt.gz"
    with gzip.open(hlo_path, "wt") as f:
        f.write(hlo)
    logits = size["device_batch_size"] * size["max_seq_len"] * size["vocab_size"]
    arrays = {(dtype, shape) for inst in parse_hlo(hlo).values() for dtype, shape in inst.arrays}
    gib = 2**30
    return {"config": f"d{size['depth']} T{size['max_seq_len']} B{size['device_batch_size']} V{size['vocab_size']}",
            "compile_s": compile_s, "argument_gib": analysis.argument_size_in_bytes / gib,
            "output_gib": analysis.output_size_in_bytes / gib, "alias_gib": analysis.alias_size_in_bytes / gib,
            "temp_gib": analysis.temp_size_in_bytes / gib, "needed_gib": needed / gib,
            "device_limit_gib": limit / gib if limit else None, "fits_this_device": needed <= limit if limit else None,
            "needed_on_8_gib": on_8 / gib, "h100_pool_gib": h100_pool / gib, "fits_h100": on_8 <= h100_pool,
            "hlo": os.path.basename(hlo_path), "hlo_mb": os.path.getsize(hlo_path) / 1e6,
            "float32_logits_sized": sorted(str(list(shape)) for dtype, shape in arrays
                                           if dtype == "f32" and size["vocab_size"] in shape
                                           and math.prod(shape) >= logits),
            "summary": f"needs {needed / gib:.2f} GiB on 1 device, ~{on_8 / gib:.2f} GiB each on 8: "
                       f"{'fits' if on_8 <= h100_pool else 'does NOT fit'} an H100's {h100_pool / gib:.1f} GiB pool"}


def _train_step(size: dict, pattern: str, steps: int) -> dict:
    from jaxchat.train.run import RunSettings
    from jaxchat.train.step_timing import time_train_step

    settings = RunSettings(depth=size["depth"], max_seq_len=size["max_seq_len"], window_pattern=pattern,
                           device_batch_size=size["device_batch_size"], num_devices=1)
    return time_train_step(settings, size["vocab_size"], steps=steps, breakdown=False)


def _step_summary(row: dict) -> str:
    mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
    return f"{row['config']}: {row['tok_per_s']:,.0f} tok/s{mfu}, peak {row['peak_memory_gib']:.1f} GiB"


def check_step(args, sizes: Sizes) -> dict:
    row = _train_step(sizes.big, "SSSL", args.steps)
    return {**row, "summary": _step_summary(row)}


def check_windows(args, sizes: Sizes) -> dict:
    rows = [_train_step(sizes.small, pattern, args.steps) for pattern in ("SSSL", "L")]
    saved = 1 - rows[0]["step_ms"] / rows[1]["step_ms"]
    return {"rows": rows, "sssl_saves": saved, "summary": f"{_step_summary(rows[0])}; SSSL saves {saved:.0%} against L"}


def check_flags_off(args, sizes: Sizes) -> dict:
    row = _train_step(sizes.small, "SSSL", args.steps)
    return {**row, "xla_flags": os.environ.get("XLA_FLAGS", ""), "summary": _step_summary(row) + " without the GPU defaults"}


def attention_agreement(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, window: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxchat.model.attention import causal_attention

    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq_len, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq_len, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq_len, kv_heads, head_dim), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.bfloat16)

    def run(implementation):
        out, vjp = jax.vjp(lambda q, k, v: causal_attention(q, k, v, window, implementation), q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *vjp(cotangent))]

    cudnn, xla = run("cudnn"), run("xla")
    errors = [float(np.abs(a - b).max() / (np.abs(b).max() + 1e-6)) for a, b in zip(cudnn, xla)]
    return {"case": f"B{batch} T{seq_len} H{heads}/{kv_heads} D{head_dim} window {window}",
            "out_rel_err": errors[0], "grad_rel_err": max(errors[1:]), "ok": max(errors) < TOLERANCE}


def attention_time(batch: int, seq_len: int, heads: int, head_dim: int, window: int, repeats: int = 20) -> float:
    import jax
    import jax.numpy as jnp

    from jaxchat.model.attention import causal_attention

    q = k = v = jnp.ones((batch, seq_len, heads, head_dim), jnp.bfloat16)
    loss = lambda q, k, v: causal_attention(q, k, v, window, "cudnn").astype(jnp.float32).sum()  # noqa: E731
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    jax.block_until_ready(step(q, k, v))
    start = time.perf_counter()
    for _ in range(repeats):
        out = step(q, k, v)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def check_attention(args, sizes: Sizes) -> dict:
    import jax

    if jax.default_backend() != "gpu":  # said plainly: without a GPU, JAX's own error depends on its plugins
        raise RuntimeError(f"cuDNN attention needs an NVIDIA GPU; this backend is {jax.default_backend()}")
    agreement = [attention_agreement(*case) for case in sizes.attention]
    batch, seq_len, heads, head_dim = sizes.window
    half, full = (attention_time(batch, seq_len, heads, head_dim, w) for w in (seq_len // 2, seq_len))
    result = {"agreement": agreement, "window_half_ms": 1e3 * half, "window_full_ms": 1e3 * full,
              "window_saving": 1 - half / full,
              "summary": f"worst relative error {max(max(r['out_rel_err'], r['grad_rel_err']) for r in agreement):.1e}; "
                         f"window T/2 saves {1 - half / full:.0%} of fwd+bwd"}
    if not all(row["ok"] for row in agreement):
        result["error"] = "cuDNN attention disagrees with the XLA path beyond bf16 rounding"
    return result


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    check: Callable[[argparse.Namespace, Sizes], dict]
    gpu_s: float  # estimated cost on an H100/H200 on first contact, compilation included
    cpu_s: float  # the d2 version on a CPU (--allow-cpu)


ENVIRONMENT = Item("environment", check_environment, 20, 5)  # always runs first: it tells a GPU from a CPU
WINDOWS = Item("windows_d12", check_windows, 120, 15)
FLAGS_OFF = Item("flags_off", check_flags_off, 75, 10)  # runs without the GPU defaults, against WINDOWS' SSSL row
ITEMS = [ENVIRONMENT, Item("memory_d20", check_memory, 150, 10), Item("step_d20", check_step, 90, 10), WINDOWS,
         Item("attention", check_attention, 45, 5), FLAGS_OFF]
ITEM_BY_NAME = {item.name: item for item in ITEMS}


def run_item(args) -> int:
    """Child mode: one measurement, its result (or error) written to --result."""
    from jaxchat.common import quiet_jax_warnings

    quiet_jax_warnings()
    size = sizes(args.allow_cpu, device_batch_size(args))
    try:
        result = ITEM_BY_NAME[args.item].check(args, size)
        error = result.pop("error", None)
    except Exception as e:  # noqa: BLE001 -- recorded for the report, and the next measurement runs
        result, error = {}, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
    with open(args.result, "w") as f:
        json.dump({"result": result, "error": error}, f, default=str)
    return 1 if error else 0


# ---- the driver: one child per measurement, the report after each --------------------------------
def write_report(path: str, report: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=2, default=str)
    os.replace(tmp, path)  # never a half-written report, whenever the run is cut


def run_child(item: Item, args, env: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        command = [sys.executable, "-m", "scripts.gpu_check", "--item", item.name, "--result", result_path,
                   "--json", args.json, "--device-batch-size", str(device_batch_size(args)), "--steps", str(args.steps)]
        command += ["--allow-cpu"] if args.allow_cpu else []
        start = time.monotonic()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            stderr = done.stderr
        except subprocess.TimeoutExpired as e:  # the child is killed; what it printed is bytes here
            done, stderr = None, e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        record = {"name": item.name, "seconds": round(time.monotonic() - start, 1)}
        if os.path.exists(result_path):
            with open(result_path) as f:
                outcome = json.load(f)
            record.update(status="failed" if outcome["error"] else "ok", result=outcome["result"])
            if outcome["error"]:
                record["error"] = outcome["error"]
        elif done is None:
            record.update(status="failed", error=f"stopped after {timeout:.0f} s, the time left\n{stderr[-1500:]}")
        else:  # no result: the process died (abort, out of memory, signal)
            record.update(status="failed", error=f"exit status {done.returncode}\n{stderr[-3000:]}")
        return record


def child_environments(args) -> tuple[dict, dict]:
    """(with the GPU runtime defaults, without): the user's environment with this checkout importable
    and a compilation cache shared by the children (a step compiled for memory_d20 need not be
    compiled again for step_d20), plus the defaults for the first."""
    from jaxchat.distributed.runtime import gpu_defaults

    base = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    base.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxchat_gpu_check_cache"))
    with_defaults = base if args.no_runtime_defaults else {**base, **gpu_defaults(base)}
    return with_defaults, base


def run_all(args) -> int:
    from jaxchat.distributed.runtime import will_run_on_gpu

    if not args.allow_cpu and not will_run_on_gpu():
        print("error: no GPU (no CUDA plugin for JAX, no NVIDIA device, or JAX_PLATFORMS says otherwise); this script "
              "measures the GPU path. --allow-cpu runs its d2 versions on the CPU.", file=sys.stderr)
        return 2
    args.json = os.path.abspath(args.json)  # the children write the HLO next to it
    with_defaults, without = child_environments(args)
    names = args.only or [item.name for item in ITEMS]
    items = [item for item in ITEMS if item.name in names or item is ENVIRONMENT]
    report = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "budget_s": args.budget_s,
              "mode": "cpu (--allow-cpu, d2 sizes)" if args.allow_cpu else "gpu",
              "runtime_defaults": "off" if args.no_runtime_defaults else {
                  k: v for k, v in with_defaults.items() if with_defaults.get(k) != without.get(k)},
              "items": []}
    start = time.monotonic()
    for item in items:
        left = args.budget_s - (time.monotonic() - start)
        cost = item.cpu_s if args.allow_cpu else item.gpu_s
        if item is not ENVIRONMENT and cost > left:  # the environment is how a CPU is told apart: always run
            record = {"name": item.name, "status": "skipped", "seconds": 0.0,
                      "error": f"estimated {cost:.0f} s, {max(left, 0):.0f} s of the budget left"}
        else:
            env = without if item is FLAGS_OFF else with_defaults
            floor = ENVIRONMENT_TIMEOUT_S if item is ENVIRONMENT else cost
            record = run_child(item, args, env, timeout=max(left, floor))
        if item is FLAGS_OFF and record["status"] == "ok":
            on = next((r for r in report["items"] if r["name"] == WINDOWS.name and r["status"] == "ok"), None)
            if on:
                record["result"]["defaults_speedup"] = on["result"]["rows"][0]["tok_per_s"] / record["result"]["tok_per_s"]
                record["result"]["summary"] += f"; the defaults run {record['result']['defaults_speedup']:.2f}x as fast"
        report["items"].append(record)
        write_report(args.json, report)
        summary = record.get("result", {}).get("summary") or (record.get("error") or "").split("\n")[0]
        print(f"{item.name:12s} {record['status']:8s} {record['seconds']:6.1f}s  {summary}", flush=True)
        if item is ENVIRONMENT:
            backend = record.get("result", {}).get("backend")
            if record["status"] != "ok" or (backend != "gpu" and not args.allow_cpu):
                print(f"error: JAX's backend is {backend or 'not starting'}, not a GPU: nothing else measured",
                      file=sys.stderr)
                return 2
    return 1 if any(r["status"] == "failed" for r in report["items"]) else 0


# ---- compile only: the real step compiled for H100 targets, no GPU needed ---------------------------
MEMORY_COLUMNS = [("devices", "{:d}"), ("peak", "{:.2f}"), ("temporaries", "{:.2f}"), ("arguments", "{:.2f}"),
                  ("parameters", "{:.2f}"), ("optimizer_state", "{:.2f}"), ("of_pool", "{:.0%}"), ("lower_s", "{:.1f}"),
                  ("compile_s", "{:.1f}")]
ATTENTION_COLUMNS = [("devices", "{:d}"), ("direction", "{}"), ("window", "{:d}"), ("count", "{:d}")]
COLLECTIVE_COLUMNS = [("devices", "{:d}"), ("kind", "{}"), ("count", "{:d}"), ("size_gib", "{:.3f}"), ("moved_gib", "{:.3f}")]


def print_compile_reports(reports: list[dict]) -> None:
    from jaxchat.common import format_table
    from jaxchat.compiled.compile_only import is_tpu_target

    pool = ("a TPU chip's HBM" if is_tpu_target(reports[0]["target"])
            else "XLA's pool (the memory fraction of jaxchat.distributed.runtime)")
    print(f"{reports[0]['config'].rsplit(' x', 1)[0]} | GiB per device; of_pool: the peak against {pool}, "
          f"{reports[0]['pool_gib']:.1f} GiB")
    print(format_table([{"devices": r["devices"], **r["memory_gib"], "of_pool": r["peak_share_of_pool"],
                         "lower_s": r["lower_s"], "compile_s": r["compile_s"]} for r in reports], MEMORY_COLUMNS))
    if any(r["kernels"]["attention"] for r in reports):
        print("\ncuDNN attention calls (window: XLA's sliding_window_length, 0 for the whole causal context):")
        print(format_table([{"devices": r["devices"], **row} for r in reports for row in r["kernels"]["attention"]],
                           ATTENTION_COLUMNS))
    for r in reports:
        print(f"on {r['devices']} device(s): GEMMs {r['kernels']['gemm'] or 'none'}; splash attention kernels "
              f"{r['kernels']['splash'] or 'none'}; other custom calls {r['kernels']['other'] or 'none'}")
    print("\ncollectives of one step (ring convention, bytes moved per device):")
    print(format_table([{"devices": r["devices"], **row} for r in reports for row in r["collectives"]],
                       COLLECTIVE_COLUMNS))
    for r in reports:
        if "remat_auto" in r:
            auto = r["remat_auto"]
            print(f"\non {r['devices']} device(s), {auto['report']}\n  (jaxchat's estimate, made for GPUs, chose "
                  f"{auto['estimate_chose']}; the times are each candidate's tracing and compiling)")
    for r in reports:
        if "zero1_minimum_gib" in r:
            print(f"{r['devices']} devices: ZeRO-1's minimum {r['zero1_minimum_gib']:.3f} GiB; this step moves "
                  f"{r['moved_over_minimum']:.2f}x that")
        if "predicted" in r:
            print_prediction(r)


def print_prediction(report: dict) -> None:
    """XLA:TPU's predicted step (jaxchat.compiled.tpu_cost), with what its cost model does not see."""
    p = report["predicted"]
    moved = next(row["moved_gib"] for row in report["collectives"] if row["kind"] == "all")
    unknown = [name for name, trips in p["loops"] if trips is None]
    print(f"\nXLA:TPU's prediction, not a measurement on a TPU: step {p['step_s'] * 1e3:.1f} ms = "
          f"{p['xla_s'] * 1e3:.1f} ms of its cost model's cycles at {p['clock_hz'] / 1e9:.2f} GHz (loops times "
          f"their trip counts) + {p['splash_s'] * 1e3:.1f} ms of splash kernels, which it prices at 0: their "
          f"FLOPs at an assumed {p['splash_efficiency']:.0%} of the chip's peak")
    print(f"  {p['tok_per_s_per_chip']:,.0f} tok/s per chip, MFU {p['mfu']:.1%} of "
          f"{p['peak_flops_per_chip'] / 1e12:.0f} TFLOP/s bf16 per chip")
    print(f"  not priced (executions): {', '.join(f'{k} {v}' for k, v in p['unpriced'].items()) or 'nothing'}; "
          f"the collectives move {moved:.3f} GiB per device, their time is not in the step"
          + (f"; loops of unknown trip count, counted once: {', '.join(unknown)}" if unknown else ""))


def run_compile_only(args) -> int:
    """The step of the given settings compiled for each --devices count of H100s; exit 1 if one does not
    compile or its peak is above XLA's pool, 2 if it cannot be tried here."""
    from jaxchat.common import quiet_jax_warnings
    from jaxchat.compiled.compile_only import CompileOnlyError, check_target, compile_for_target, is_tpu_target
    import jax

    from jaxchat.train.settings import SettingsError, settings_from_flags

    if "JAX_PLATFORMS" not in os.environ:  # the devices are the CUDA plugin's compile-only ones: no GPU backend
        jax.config.update("jax_platforms", "cpu")  # is started, so a machine without a GPU needs no setting
    quiet_jax_warnings()
    try:
        settings = settings_from_flags(args)
    except SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_target(args.target)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reports, failed = [], []
    # a TPU target's topology is its chips: one report
    for devices in [None] if is_tpu_target(args.target) else args.devices:
        try:
            report = compile_for_target(settings, args.vocab_size, devices, target=args.target,
                                        accumulate=args.accumulate)
        except (CompileOnlyError, SettingsError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except Exception as e:  # noqa: BLE001 -- a step that does not compile is the finding: report it, go on
            failed.append({"devices": devices, "target": args.target, "error": f"{type(e).__name__}: {e}"[:3000]})
            where = args.target if devices is None else f"{devices} device(s)"
            print(f"error: the step on {where} did not compile: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
            continue
        hlo = report.pop("hlo")
        if args.json:
            report["hlo_file"] = f"{os.path.splitext(args.json)[0]}.x{report['devices']}.hlo.txt.gz"
            with gzip.open(report["hlo_file"], "wt") as f:
                f.write(hlo)
        reports.append(report)
    if reports:
        print_compile_reports(reports)
    over = [r for r in reports if r["peak_share_of_pool"] > 1]
    for r in over:
        print(f"error: {r['config']}: peak {r['memory_gib']['peak']:.1f} GiB per device is above the "
              f"{r['pool_gib']:.1f} GiB it may use: lower --device-batch-size or use --remat block", file=sys.stderr)
    if args.json:
        write_report(args.json, {"started": datetime.datetime.now().isoformat(timespec="seconds"),
                                 "mode": "compile-only", "settings": dataclasses.asdict(settings),
                                 "target": args.target, "vocab_size": args.vocab_size, "reports": reports,
                                 "failed": failed})
    return 1 if failed or over else 0


def default_report_path(args) -> str:
    """<base_dir>/gpu_check/<mode and target>.json: not the current directory (a checkout's root), and a TPU
    target's compile never overwrites an H100 one's (the HLO files are named after the report)."""
    from jaxchat.common import local_dir

    name = f"compile_only_{args.target.replace(':', '-')}" if args.compile_only else "gpu_check"
    return os.path.join(local_dir(), "gpu_check", f"{name}.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="the report, rewritten after each measurement, the HLO files "
                        "beside it (default: <base_dir>/gpu_check/, one name per mode and target)")
    parser.add_argument("--budget-s", type=float, default=480.0, help="seconds for all measurements: what will "
                        "not fit in the time left is skipped")
    parser.add_argument("--only", nargs="+", choices=[item.name for item in ITEMS], default=None,
                        help="these measurements only (the environment always runs)")
    parser.add_argument("--compile-only", action="store_true", help="no GPU needed (the cuda12 extra is): compile "
                        "the train step of the run settings below for --devices H100s, report its memory, kernels "
                        "and collectives; exit 1 if it does not compile or does not fit")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, ZERO1_DEVICES],
                        help="with --compile-only: H100 counts to compile for, one report each")
    parser.add_argument("--target", default="h100", help="with --compile-only: h100, or a TPU chip and topology "
                        "(v4, v5e, v5p, v6e: e.g. v6e:2x4, v5e:4x8, v5p:2x2x1), whose chips the step is compiled for")
    parser.add_argument("--vocab-size", type=int, default=SPEEDRUN_VOCAB_SIZE, help="with --compile-only")
    parser.add_argument("--accumulate", action="store_true", help="with --compile-only: the step with the run's "
                        "gradient accumulation (--total-batch-size), not one micro-batch per device")
    parser.add_argument("--steps", type=int, default=10, help="timed train steps per configuration")
    parser.add_argument("--allow-cpu", action="store_true", help="no GPU: run the d2 versions on the CPU")
    parser.add_argument("--no-runtime-defaults", action="store_true",
                        help="run every measurement without jaxchat's GPU runtime defaults")
    parser.add_argument("--item", default=None, help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    from jaxchat.common import fail
    from jaxchat.train.settings import add_setting_flags
    from jaxchat.checkpoint.staged_files import make_parent_dir

    add_setting_flags(parser)  # scripts.train's; --device-batch-size also sizes the d12/d20 steps of a GPU run
    args = parser.parse_args(argv)
    if args.json is None and not args.item:
        args.json = default_report_path(args)
        print(f"The report goes to {args.json} (--json to choose)", flush=True)
    if args.json:
        try:
            make_parent_dir(args.json)
        except OSError as e:
            fail(f"--json {args.json}: {e}")
    if args.compile_only:
        sys.exit(run_compile_only(args))
    sys.exit(run_item(args) if args.item else run_all(args))


if __name__ == "__main__":
    main()
