"""GPU runtime defaults: the XLA flags and memory fraction a GPU training run starts with.

XLA reads $XLA_FLAGS and JAX reads $XLA_PYTHON_CLIENT_MEM_FRACTION once, when the backend starts, so
apply_gpu_defaults must run before anything asks JAX for a device. It only fills in what the user has
not set (a flag already in $XLA_FLAGS, or a fraction already in the environment, wins), and only when
the run will be on a GPU: CPU runs start exactly as they would without it.

An unknown XLA flag aborts the process at start-up, so the set is small and made of flags that XLA
marks [Stable] in its own help text, or whose trade-off that text documents (the slop factor);
tests/test_runtime.py starts JAX with them. Flags that have been renamed between releases (the
collective pipelining switches, xla_gpu_enable_pipelined_* -> xla_gpu_pipeline_*) are left out for
that reason. Sources: JAX's "GPU performance tips", NVIDIA JAX-Toolbox's "Tips for high-performance
LLMs with JAX and XLA", and MaxText's H100 (a3) recipes.
"""

import glob
import importlib.util
import os
import sys
from typing import Mapping, MutableMapping

GPU_XLA_FLAGS = {
    # Schedule the asynchronous collectives (the gradient reduce-scatter and parameter all-gather of
    # ZeRO-1, the all-gathers of FSDP) to overlap with compute, instead of where they fall. The one
    # flag JAX-Toolbox bakes into its images; every MaxText GPU recipe sets it.
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    # Matmuls on cuBLAS rather than Triton GEMM fusions (MaxText's H100 recipes, JAX-Toolbox): the
    # model's matmuls are large bf16 GEMMs where cuBLAS is at its best, and compilation skips
    # autotuning Triton tilings for each of them.
    "xla_gpu_enable_triton_gemm": "false",
    # The latency-hiding scheduler trades memory for overlap up to this percentage of the device's
    # memory (XLA's default: 95, above the 90% pool of GPU_MEMORY_FRACTION). At 95, d20 at device batch
    # 32 on 8 H100s is scheduled with every layer's MLP and attention weight-gradient matmul deferred to
    # the gradients' reduce-scatter, which keeps their bf16 inputs alive: 16 GiB more per device than on
    # one device (XLA's buffer assignment of the step compiled for an H100 target; docs/benchmarks.md).
    # At 25 the scheduler orders for memory first once a step needs more than a quarter of the device.
    "xla_gpu_memory_limit_slop_factor": "25",
}

# JAX preallocates 75% of GPU memory by default; d20 at device batch 32 needs more of an 80 GB H100.
# 0.90 is what JAX-Toolbox and MaxText's GPU recipes use: the rest stays for the CUDA context, cuDNN
# and NCCL workspaces, which live outside XLA's pool.
GPU_MEMORY_FRACTION = "0.90"
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"

# The CUDA plugin of JAX, as a PJRT plugin module or the plugin package (CUDA 12 and 13 builds).
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_cuda12_plugin", "jax_cuda13_plugin")


def gpu_compiler_options(environ: Mapping[str, str] = os.environ) -> dict[str, bool | int | str]:
    """The GPU flags that environ's XLA_FLAGS does not set, as compiler options for
    `.compile(compiler_options=...)`, which wants typed values ('false' as a string is refused): a step
    compiled ahead of time for a GPU target gets the options a GPU run gets, and the user's flags win
    there as they do in a run (XLA reads XLA_FLAGS for every compilation)."""
    def typed(value: str) -> bool | int | str:
        if value in ("true", "false"):
            return value == "true"
        return int(value) if value.isdigit() else value

    present = xla_flag_names(environ.get("XLA_FLAGS", ""))
    return {name: typed(value) for name, value in GPU_XLA_FLAGS.items() if name not in present}


def xla_flag_names(xla_flags: str) -> set[str]:
    """Names of the flags in an XLA_FLAGS string ('--a=1 --b' -> {'a', 'b'})."""
    return {token.lstrip("-").split("=", 1)[0] for token in xla_flags.split() if token.startswith("-")}


def missing_flags(xla_flags: str) -> list[str]:
    """The GPU flags ('--name=value') that an XLA_FLAGS string does not set."""
    present = xla_flag_names(xla_flags)
    return [f"--{name}={value}" for name, value in GPU_XLA_FLAGS.items() if name not in present]


def gpu_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to change so that environ has the GPU defaults it lacks (empty if it has them all):
    the missing flags appended to XLA_FLAGS after the user's own, and the memory fraction if unset."""
    changes = {}
    flags = environ.get("XLA_FLAGS", "").strip()
    if missing := missing_flags(flags):
        changes["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    if MEM_FRACTION_ENV not in environ:
        changes[MEM_FRACTION_ENV] = GPU_MEMORY_FRACTION
    return changes


def cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA plugin is importable (what compiling for a GPU target needs, GPU or not)."""
    for name in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # the parent package (jax_plugins) is absent
            continue
    return False


def will_run_on_gpu(device_type: str = "", environ: Mapping[str, str] = os.environ) -> bool:
    """Whether JAX's backend will be a GPU, decided without starting it: the --device-type asked for,
    else $JAX_PLATFORMS, else whether JAX's CUDA plugin is installed and an NVIDIA device is visible."""
    if device_type:
        return device_type in ("cuda", "gpu")
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() in ("cuda", "gpu") for p in platforms.split(","))
    if environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return cuda_plugin_installed() and bool(glob.glob("/dev/nvidia[0-9]*"))


def apply_gpu_defaults(device_type: str = "", environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Set the GPU defaults the user has not set, if the run will be on a GPU. Must run before JAX starts
    its backend. Returns what it set, one '--flag=value' or 'NAME=value' each (empty: nothing)."""
    if not will_run_on_gpu(device_type, environ):
        return []
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if getattr(xla_bridge, "backends_are_initialized", lambda: False)():  # the variables would be read by no one
            raise RuntimeError("apply_gpu_defaults must run before JAX starts its backend (before any jax.devices())")
    changes = gpu_defaults(environ)
    set_now = missing_flags(environ.get("XLA_FLAGS", "")) if "XLA_FLAGS" in changes else []
    set_now += [f"{MEM_FRACTION_ENV}={changes[MEM_FRACTION_ENV]}"] if MEM_FRACTION_ENV in changes else []
    environ.update(changes)
    return set_now
