"""JAX's persistent compilation cache, on by default under the base dir: where `--compilation-cache` and
$JAX_COMPILATION_CACHE_DIR put it (a bucket's included), and a second run of scripts.train loading the train step
that the first one wrote there."""

import logging
import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from jaxchat import storage
from jaxchat.distributed.compilation_cache import (CACHE_DIR_ENV, XLA_CACHES_OPTION, cache_dir,
                                                   enable_compilation_cache)
from scripts import train as train_script


@pytest.fixture
def jax_cache_config():
    """The test may move this process's cache (the session's, tests/conftest.py) and write every program there:
    put back afterwards."""
    saved = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir", XLA_CACHES_OPTION,
                                                          "jax_persistent_cache_min_compile_time_secs")}
    yield
    jax_cache.reset_cache()
    for name, value in saved.items():
        jax.config.update(name, value)


def test_the_flag_then_the_variable_then_the_base_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    assert cache_dir(None, {}) == str(tmp_path / "xla_cache")
    assert cache_dir(None, {CACHE_DIR_ENV: "/set/by/user"}) == "/set/by/user"  # the user's variable, as JAX reads it
    assert cache_dir("off", {CACHE_DIR_ENV: "/set/by/user"}) is None  # the flag is the more specific ask
    assert cache_dir(str(tmp_path / "elsewhere"), {CACHE_DIR_ENV: "/set/by/user"}) == str(tmp_path / "elsewhere")
    assert cache_dir("gs://other-bucket/cache", {}) == "gs://other-bucket/cache"
    monkeypatch.chdir(tmp_path)
    assert cache_dir("relative", {}) == str(tmp_path / "relative")  # where it was given, whatever JAX's cwd later


def test_off_turns_it_off_and_a_directory_is_used(tmp_path, jax_cache_config):
    assert enable_compilation_cache("off") is None
    assert jax.config.jax_compilation_cache_dir is None
    assert enable_compilation_cache(str(tmp_path)) == str(tmp_path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert [name for name in os.listdir(tmp_path) if name.startswith("jit_")], os.listdir(tmp_path)


def test_a_bucket_base_dir_caches_in_the_bucket(gcs, monkeypatch, jax_cache_config):
    """gs:// as the base dir: the cache is in the bucket (JAX writes there through etils.epath), and XLA's GPU
    autotuning folder, which JAX would make a local path of, is off."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", gcs)
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert enable_compilation_cache(None) == f"{gcs}/xla_cache"
    assert jax.config.jax_persistent_cache_enable_xla_caches == "none"
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.jit(lambda x: x * 5 - 2)(jnp.arange(9.0)).block_until_ready()
    assert any(name.startswith("jit_") for name in storage.listdir(f"{gcs}/xla_cache"))


def test_a_second_run_loads_the_train_step_the_first_wrote(tmp_path, monkeypatch, caplog, make_base_dir,
                                                            jax_cache_config):
    """Two runs of scripts.train with the same settings (in this process, so that nothing but the persistent cache
    can hand the second one the step: JAX's in-memory caches hold the first run's own functions), without
    $JAX_COMPILATION_CACHE_DIR: the first writes its train step under <base_dir>/xla_cache, the second loads it."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(make_base_dir(tmp_path)))
    monkeypatch.delenv(CACHE_DIR_ENV)
    caplog.set_level(logging.DEBUG, logger="jax._src.compiler")  # where JAX says each persistent cache hit
    flags = ["--depth=1", "--max-seq-len=64", "--device-batch-size=2", "--total-batch-size=128", "--num-devices=1",
             "--device-type=cpu", "--num-iterations=1", "--eval-every=-1", "--core-metric-every=-1", "--sample-every=-1"]
    train_script.main([*flags, "--model-tag=first"])
    assert [name for name in os.listdir(tmp_path / "xla_cache") if name.startswith("jit_train_step-")]
    assert not [r for r in caplog.records if "Persistent compilation cache hit for 'jit_train_step'" in r.message]
    train_script.main([*flags, "--model-tag=second"])
    assert [r for r in caplog.records if "Persistent compilation cache hit for 'jit_train_step'" in r.message]
