"""The train step compiled without running it: abstract arguments, cuDNN attention traced without
cuDNN, and the real step compiled for an H100 or a TPU slice where there is neither.

TPU targets (the `tpu` extra: libtpu): `get_topology_desc(platform="tpu", topology_name="v6e:2x4")` gives
the chips of that slice, every host's, as compile-only devices; the step is compiled by XLA:TPU with splash
attention's Mosaic kernels (jaxchat.model.splash_attention.compiling_for_tpu). A target is 'h100' or
'<chip>:<topology>', the chip one of TPU_HBM_BYTES.

JAX compiles for a GPU target without a GPU (JAX's compile-only runtime, needs the `cuda12` extra):
`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=<GpuTargetConfig text>,
topology="1x1xN")` gives N compile-only devices of that target; a mesh over them and
`.lower(...).compile()` run XLA:GPU's whole pipeline: fusion, cuDNN and cuBLAS calls, collectives and
their scheduling, buffer assignment. Without a GPU to autotune on, kernel choices are XLA's defaults,
so the memory and the program are real and speed is not measured this way.
"""

import contextlib
import dataclasses
import math
import os
import re
import tempfile
import time
from collections.abc import Callable

import jax

from jaxchat.model.footprint import per_device_bytes
from jaxchat.model.gpt import count_params
from jaxchat.compiled.hlo import collective_summary, custom_call_census, hlo_collectives
from jaxchat.distributed.mesh import make_mesh
from jaxchat.compiled.remat_choice import compiled_peak_bytes, report_choice, resolve_remat_by_compiling
from jaxchat.compiled.tpu_cost import predict_run_step
from jaxchat.train.run import Run, RunSettings, abstract_step_arguments, build_run, make_layout
from jaxchat.distributed.runtime import GPU_MEMORY_FRACTION, cuda_plugin_installed, gpu_compiler_options

TARGETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets")
H100 = "h100_sxm_80gb"  # jaxchat/compiled/targets/<name>.textproto
ASSUMED_CUDNN_VERSION = 91000  # cuDNN 9.10: past every version check of the attention gate
ASSUMED_COMPUTE_CAPABILITY = (9, 0)  # H100


GIB = 2**30
GPU_TARGETS = {"h100": H100}  # the command line's names of the GPU targets in jaxchat/compiled/targets
# The HBM that XLA:TPU gives a program on one device of each chip, as its own out-of-memory error states it
# ("exceeds available HBM (15.75G)", libtpu of JAX 0.10.2, compiled here for each topology): v5e's 16 GiB,
# v6e's 32, v5p's 95 less what the runtime keeps; v4's 32 GiB are two TensorCores' 16 each, one device each
TPU_HBM_BYTES = {"v4": int(15.25 * GIB), "v5e": int(15.75 * GIB), "v5p": int(95.74 * GIB), "v6e": int(31.25 * GIB)}


def is_tpu_target(target: str) -> bool:
    return target.split(":")[0] in TPU_HBM_BYTES


def check_target(target: str) -> None:
    """ValueError with the targets there are, unless target is 'h100' or '<chip>:<topology>' of a known chip."""
    chip, _, topology = target.partition(":")
    if target in GPU_TARGETS or target == H100 or (chip in TPU_HBM_BYTES and topology):
        return
    raise ValueError(f"unknown target {target!r}: use h100, or a TPU chip and topology such as v6e:2x4, v5e:4x8, "
                     f"v5p:2x2x1, v4:2x2x1 (chips: {', '.join(TPU_HBM_BYTES)})")


def accelerator_type(target: str) -> str:
    """Cloud TPU's name of a slice ('v6e:2x4' -> 'v6e-8'): v5e and v6e count chips, v4 and v5p TensorCores
    (two per chip); v5e's is 'v5litepod'."""
    chip, _, topology = target.partition(":")
    chips = math.prod(int(n) for n in topology.split("x"))
    names = {"v4": f"v4-{2 * chips}", "v5p": f"v5p-{2 * chips}", "v5e": f"v5litepod-{chips}"}
    return names.get(chip, f"{chip}-{chips}")


def tpu_devices(target: str) -> list:
    """The compile-only chips of a TPU slice (every host's). Raises CompileOnlyError without libtpu."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        raise CompileOnlyError("compiling for a TPU target needs libtpu: pip install -e '.[tpu]' (no TPU needed), "
                               "then run with JAX_PLATFORMS=cpu") from e
    from jax.experimental import topologies

    # libtpu takes a lock file for the TPU it would drive; compiling uses no TPU, so two compilations (two
    # recipes side by side, a test beside another) need not wait for each other
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Loading, libtpu asks the machine which TPU it is and which hosts its slice has, and off a TPU VM warns on
    # stderr that it could not tell: answered here with the target's Cloud name and this host, read once per
    # process when libtpu loads. The name only has to be one libtpu knows ('bogus' still warns); the devices
    # are the topology's whatever it says (v6e-8, then v5e:4x8 in one process: 32 v5e chips). A TPU VM's own
    # values, where set, stay.
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accelerator_type(target))
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    return list(topologies.get_topology_desc(platform="tpu", topology_name=target).devices)


class CompileOnlyError(RuntimeError):
    """Compiling for a GPU target cannot start here; the message says what to install."""


class StepDidNotCompile(RuntimeError):
    """XLA refused the step (out of memory, most often): the message names the configuration, the remat
    policy --remat auto chose included."""


def target_config(target: str = H100) -> str:
    """The GpuTargetConfig text of a target kept in jaxchat/compiled/targets."""
    with open(os.path.join(TARGETS_DIR, f"{target}.textproto")) as f:
        return f.read()


def target_memory_bytes(target: str = H100) -> int:
    """The device memory the target declares (what XLA's allocator and scheduler are sized from)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(target)).group(1))


def target_pool_bytes(target: str = H100) -> int:
    """XLA's memory pool on the target at scripts.train's memory fraction (jaxchat.distributed.runtime)."""
    return int(target_memory_bytes(target) * float(GPU_MEMORY_FRACTION))


def target_devices(num_devices: int, target: str = H100) -> list:
    """num_devices compile-only devices of the target, on one host. Raises CompileOnlyError without
    JAX's CUDA plugin."""
    if not cuda_plugin_installed():
        raise CompileOnlyError("compiling for a GPU target needs JAX's CUDA plugin: pip install -e '.[cuda12]' "
                               "(about 6 GB; no GPU needed), then run with JAX_PLATFORMS=cpu")
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                            topology=f"1x1x{num_devices}")
    return list(topology.devices)


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


def abstract_step_settings(settings: RunSettings, world: int, accumulate: bool = False) -> RunSettings:
    """The settings of a step compiled on its own: world devices, one micro-batch per step, or with accumulate
    the run's own gradient accumulation (its --total-batch-size); a horizon that no flag can make too short."""
    one_micro_batch = settings.device_batch_size * settings.max_seq_len * world
    return dataclasses.replace(settings, num_iterations=1000, num_devices=world,
                               total_batch_size=settings.total_batch_size if accumulate else one_micro_batch)


def abstract_step(settings: RunSettings, vocab_size: int, mesh, *, memory_budget: tuple[int, str] | None = None,
                  accumulate: bool = False) -> tuple[Run, object, tuple]:
    """The run of these settings (abstract_step_settings), its jitted step and the step's abstract arguments
    (ShapeDtypeStructs carrying their shardings). memory_budget: (bytes, where from) of the device that
    --remat auto's estimate decides for, where it is not this machine's (build_run)."""
    settings = abstract_step_settings(settings, mesh.devices.size, accumulate)
    run = build_run(settings, vocab_size, mesh=mesh, memory_budget=memory_budget)
    return run, run.train_step(), abstract_step_arguments(run)


def describe(settings: RunSettings, vocab_size: int, remat: str, num_devices: int, target: str, suffix: str) -> str:
    """A compiled step's configuration in one line: 'd20 T2048 B16 V65536 SSSL remat=block x8 v6e:2x4 ...'."""
    return (f"d{settings.depth} T{settings.max_seq_len} B{settings.device_batch_size} V{vocab_size} "
            f"{settings.window_pattern} remat={remat} x{num_devices} {target}{suffix}")


def zero1_minimum_bytes(params, num_devices: int) -> float:
    """What ZeRO-1 must move per device and step: a reduce-scatter of the float32 gradients and an
    all-gather of the float32 parameters, (n-1)/n of the whole each (the ring convention). Every
    parameter counts: not the recipe's scaling count (92d63d4's leaves out the embeddings)."""
    return 2 * (num_devices - 1) / num_devices * 4 * count_params(params)


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


def for_gpu(settings: RunSettings) -> RunSettings:
    """The settings as a GPU run resolves them: 'auto' attention is cuDNN, the compute dtype bf16."""
    return dataclasses.replace(settings, attention="cudnn" if settings.attention == "auto" else settings.attention,
                               compute_dtype=settings.compute_dtype or "bfloat16")


def for_tpu(settings: RunSettings) -> RunSettings:
    """The settings as a TPU run resolves them: 'auto' attention is splash, the compute dtype bf16."""
    return dataclasses.replace(settings, attention="splash" if settings.attention == "auto" else settings.attention,
                               compute_dtype=settings.compute_dtype or "bfloat16")


def compile_setup(target: str, num_devices: int | None):
    """(settings rule, devices, memory the program may use, tracing context, XLA options) of a target.
    num_devices: the H100s; a TPU target's topology sets its chips."""
    if is_tpu_target(target):
        from jaxchat.model.splash_attention import compiling_for_tpu

        return for_tpu, tpu_devices(target), TPU_HBM_BYTES[target.split(":")[0]], compiling_for_tpu(), {}
    return (for_gpu, target_devices(num_devices, target), target_pool_bytes(target), cudnn_without_gpu(),
            gpu_compiler_options())


def compile_for_target(settings: RunSettings, vocab_size: int, num_devices: int | None, *, target: str = H100,
                       compiler_options: dict | None = None, accumulate: bool = False) -> dict:
    """The real train step of these settings (one micro-step, device_batch_size rows per device; with
    accumulate, all the micro-steps of --total-batch-size, as the run compiles it)
    compiled for num_devices devices of the target (an H100) or for the chips of a TPU topology
    ('v6e:2x4'), with a GPU run's XLA options (jaxchat.distributed.runtime) on a GPU, updated by compiler_options
    (e.g. xla_dump_to). 'pool_gib' is what the program may use: XLA's pool of a GPU run, a TPU chip's HBM.
    --remat auto compiles its candidates as a run on the target would (jaxchat.compiled.remat_choice).
    Returns its figures (GiB per device):
    memory       XLA's memory analysis: arguments, outputs, what they alias, temporaries, and the peak
                 (arguments + outputs - aliased + temporaries); the state's share of the arguments
    kernels      the custom-call census (jaxchat.compiled.hlo.custom_call_census)
    collectives  per kind, the bytes each device moves, against ZeRO-1's minimum
    times        tracing and lowering, then XLA's compilation, in seconds (with auto: all its candidates)
    predicted    on a TPU target, XLA:TPU's predicted step time, tokens/s per chip and MFU
                 (jaxchat.compiled.tpu_cost.predict_step): the compiler's cost model, not a measurement
    remat_auto   with --remat auto: the rule's report (remat_choice.report_choice), each candidate's peak and
                 prediction, and what the GPU estimate would have chosen (jaxchat.model.footprint)
    and 'hlo', the optimised module's text."""
    target = GPU_TARGETS.get(target, target)
    resolve, devices, pool, tracing, options = compile_setup(target, num_devices)
    settings, num_devices = resolve(settings), len(devices)
    options = {**options, **(compiler_options or {})}
    mesh = make_mesh(devices=devices)
    budget = (pool, f"{target}'s memory")

    def config(remat: str) -> str:  # what an error names: the configuration XLA refused
        return describe(settings, vocab_size, remat, num_devices, target, " with accumulation" if accumulate else "")

    start = time.perf_counter()
    with tracing:
        if settings.remat == "auto":
            run, compiled, remat_auto = _compile_auto(settings, vocab_size, mesh, budget, options, accumulate, config)
            compile_s = lower_s = time.perf_counter() - start
        else:
            run, step, args = abstract_step(settings, vocab_size, mesh, memory_budget=budget, accumulate=accumulate)
            lowered = step.trace(*args).lower()
            lower_s = time.perf_counter() - start
            start = time.perf_counter()
            try:
                compiled = lowered.compile(compiler_options=options)
            except Exception as e:  # noqa: BLE001 -- XLA's own error (e.g. out of memory), with what was compiled
                raise StepDidNotCompile(f"{config(settings.remat)}: {type(e).__name__}: {e}") from e
            compile_s, remat_auto = time.perf_counter() - start, None
    return _compiled_figures(run, compiled, devices, target, pool, remat_auto, lower_s, compile_s)


def _compile_auto(settings: RunSettings, vocab_size: int, mesh, budget: tuple[int, str], options: dict,
                  accumulate: bool, config: Callable[[str], str]):
    """--remat auto by compiling (jaxchat.compiled.remat_choice): (the chosen run, its compiled step, the report)."""
    step_settings = abstract_step_settings(settings, mesh.devices.size, accumulate)
    estimate_chose = build_run(step_settings, vocab_size, mesh=mesh, memory_budget=budget).settings.remat
    resolved, chosen, candidates = resolve_remat_by_compiling(step_settings, vocab_size, make_layout(step_settings, mesh),
                                                              budget, options, estimate=estimate_chose)
    if chosen.compiled is None:  # XLA refused every candidate
        raise StepDidNotCompile(f"{config('auto')}: XLA refused every policy: "
                                + "; ".join(f"{c.policy}: {c.refusal}" for c in candidates))
    report = {"chosen": resolved.remat, "fits": chosen.fits, "estimate_chose": estimate_chose,
              "report": report_choice(chosen, candidates, budget),
              "candidates": [{"policy": c.policy, "peak_gib": None if c.peak_bytes is None else c.peak_bytes / GIB,
                              "fits": c.fits, "predicted_s": c.predicted_s, "compile_s": c.compile_s,
                              "refusal": c.refusal} for c in candidates]}
    return chosen.run, chosen.compiled, report


def _compiled_figures(run: Run, compiled, devices: list, target: str, pool: int, remat_auto: dict | None,
                      lower_s: float, compile_s: float) -> dict:
    """compile_for_target's figures of the compiled step of a run."""
    num_devices, settings = len(devices), run.settings
    analysis = compiled.memory_analysis()
    peak = compiled_peak_bytes(compiled)
    state = run.state
    memory = {"arguments": analysis.argument_size_in_bytes / GIB, "outputs": analysis.output_size_in_bytes / GIB,
              "aliased": analysis.alias_size_in_bytes / GIB, "temporaries": analysis.temp_size_in_bytes / GIB,
              "parameters": per_device_bytes(state.params, state.param_shardings) / GIB,
              "optimizer_state": per_device_bytes(state.opt_state, state.opt_shardings) / GIB,
              "peak": peak / GIB}
    hlo = compiled.as_text()
    found = hlo_collectives(hlo, num_devices)
    remat = f"{settings.remat} (auto)" if remat_auto is not None else settings.remat
    accumulation = f" accumulation {run.grad_accum_steps}" if run.grad_accum_steps > 1 else ""
    result = {"config": describe(settings, run.config.vocab_size, remat, num_devices, target, accumulation),
              "devices": num_devices, "target": target, "memory_gib": memory,
              "pool_gib": pool / GIB, "peak_share_of_pool": peak / pool,
              "kernels": custom_call_census(hlo), "collectives": collective_summary(found),
              "lower_s": lower_s, "compile_s": compile_s, "hlo": hlo}
    if remat_auto is not None:
        result["remat_auto"] = remat_auto
    if is_tpu_target(target):
        result["predicted"] = predict_run_step(hlo, run, devices)
    if num_devices > 1:
        minimum = zero1_minimum_bytes(run.state.params, num_devices)
        result.update(zero1_minimum_gib=minimum / GIB,
                      moved_over_minimum=sum(c["moved"] for c in found) / minimum)
    return result
