"""The GPU runtime defaults: the flag set starts JAX, user settings win, CPU runs are left alone."""

import json
import os
import subprocess
import sys

import jax
import pytest

from jaxchat.distributed.runtime import (GPU_MEMORY_FRACTION, GPU_XLA_FLAGS, MEM_FRACTION_ENV, apply_gpu_defaults, gpu_compiler_options,
                              gpu_defaults)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_JAX = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"


def start_jax_with(xla_flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
    return subprocess.run([sys.executable, "-c", START_JAX], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_the_flag_set_starts_jax():
    # The CPU jaxlib registers XLA's GPU flags too, and aborts at start-up on a name it does not know:
    # so a run that starts and computes proves every name and value parses in this JAX version.
    flags = gpu_defaults({})["XLA_FLAGS"]
    assert flags.split() == [f"--{name}={value}" for name, value in GPU_XLA_FLAGS.items()]
    ok = start_jax_with(flags)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.strip() == "3.0"
    # the same check fails on a flag XLA does not know: the test can tell the two apart
    bad = start_jax_with(flags + " --xla_gpu_no_such_flag_for_jaxchat=true")
    assert bad.returncode != 0
    assert "xla_gpu_no_such_flag_for_jaxchat" in bad.stderr


def test_user_settings_win():
    user = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false",
            MEM_FRACTION_ENV: "0.5"}
    changes = gpu_defaults(user)
    assert MEM_FRACTION_ENV not in changes  # the user's fraction stays
    flags = changes["XLA_FLAGS"].split()
    assert flags[:2] == user["XLA_FLAGS"].split()  # the user's flags first and unchanged
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in flags
    assert flags[2:] == [f"--{name}={value}" for name, value in GPU_XLA_FLAGS.items()
                         if name != "xla_gpu_enable_latency_hiding_scheduler"]
    # everything already set: nothing to change
    full = {"XLA_FLAGS": " ".join(f"--{name}=x" for name in GPU_XLA_FLAGS), MEM_FRACTION_ENV: "0.8"}
    assert gpu_defaults(full) == {}


def test_cpu_runs_are_left_alone():
    for device_type, environ in (("cpu", {}), ("", {"JAX_PLATFORMS": "cpu"}), ("", {"CUDA_VISIBLE_DEVICES": ""}),
                                 ("tpu", {})):
        before = dict(environ)
        assert apply_gpu_defaults(device_type, environ) == []
        assert environ == before


@pytest.mark.slow
def test_gpu_run_gets_the_defaults_before_jax_starts():
    # a fresh process that never imports JAX, as scripts.train's first lines
    code = ("import json; from jaxchat.distributed.runtime import apply_gpu_defaults; env = {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}; "
            "print(json.dumps([apply_gpu_defaults('cuda', env), env]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    set_now, env = json.loads(out.stdout)
    expected_flags = [f"--{name}={value}" for name, value in GPU_XLA_FLAGS.items()]
    assert set_now == expected_flags + [f"{MEM_FRACTION_ENV}={GPU_MEMORY_FRACTION}"]
    assert env == {"XLA_FLAGS": " ".join(["--xla_dump_to=/tmp/x", *expected_flags]), MEM_FRACTION_ENV: GPU_MEMORY_FRACTION}


def test_too_late_once_jax_has_started():
    jax.devices()  # this process's backend is up: the variables would be read by no one
    with pytest.raises(RuntimeError, match="before JAX starts"):
        apply_gpu_defaults("cuda", {})


def test_compiler_options_are_typed_and_leave_the_users_flags():
    # .compile(compiler_options=...) refuses 'false' as a string: booleans and integers go typed
    options = gpu_compiler_options({})
    assert options["xla_gpu_enable_triton_gemm"] is False
    assert options["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert options["xla_gpu_memory_limit_slop_factor"] == int(GPU_XLA_FLAGS["xla_gpu_memory_limit_slop_factor"])
    assert set(options) == set(GPU_XLA_FLAGS)
    # a flag the user put in XLA_FLAGS is theirs, as in a GPU run
    user = gpu_compiler_options({"XLA_FLAGS": "--xla_gpu_memory_limit_slop_factor=95"})
    assert set(user) == set(GPU_XLA_FLAGS) - {"xla_gpu_memory_limit_slop_factor"}
