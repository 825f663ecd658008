"""JAX's persistent compilation cache, on by default under the base dir (`<base_dir>/xla_cache`, local or gs://):
a resumed or requeued run, a second run of the same settings, and every evaluation script load the compiled
programs instead of compiling them again (docs/benchmarks.md measures the difference).

Which directory: `--compilation-cache DIR` (or `off`) where given; else $JAX_COMPILATION_CACHE_DIR where the user
set it (JAX reads it itself when it is imported); else the base dir's. What JAX does with it (jax 0.10,
jax/_src/compiler.py and compilation_cache.py):
- a program is written once it took at least jax_persistent_cache_min_compile_time_secs to compile (JAX's default,
  1 s, kept: the train and evaluation steps take seconds to minutes, the eager operations and small helpers ~0.05 s,
  and from a bucket each entry is a round trip that a sub-second compile is not worth); no size threshold
  (jax_persistent_cache_min_entry_size_bytes 0) and no eviction (jax_compilation_cache_max_size -1): delete the
  folder to reclaim its space;
- the key hashes the program, the compile options and XLA flags, the devices and the jax/jaxlib versions: another
  setting or another release is another entry, never a stale program;
- several processes: only process 0 writes (`_cache_write`, to spare shared filesystems such as GCS many writers);
  every process reads. On GPUs the key leaves out the device assignment, so that every host finds process 0's
  entries: a gs:// base dir (or one on a shared filesystem) serves them all, while a local base dir on each host
  serves process 0 alone (the others compile as without a cache). On the CPU each process's keys are its own
  (tests/every_process_caches).
A cache entry that cannot be read or written is a warning and a compile, never a failed run.
"""

import os

import jax
from jax.experimental.compilation_cache import compilation_cache

from jaxchat import storage
from jaxchat.common import get_base_dir

CACHE_SUBDIR = "xla_cache"
OFF = "off"
CACHE_DIR_ENV = "JAX_COMPILATION_CACHE_DIR"
# On a GPU, JAX also points XLA's per-fusion autotuning cache at a folder of the cache dir, a path it makes with
# pathlib, which turns gs://bucket/x into gs:/bucket/x: a relative local path, not the bucket. In a bucket that
# cache is off (autotuning results are still inside each cached executable; only a recompiled program retunes).
XLA_CACHES_OPTION = "jax_persistent_cache_enable_xla_caches"
FLAG_HELP = (f"where compiled programs are kept for the next run (JAX's persistent compilation cache): a directory "
             f"or gs:// URL, or '{OFF}' (default: ${CACHE_DIR_ENV} if set, else <base_dir>/{CACHE_SUBDIR})")


def cache_dir(setting: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The compilation cache's directory for a `--compilation-cache` value: None for `off`; the directory given;
    without one, $JAX_COMPILATION_CACHE_DIR where set, else `<base_dir>/xla_cache`."""
    environ = os.environ if environ is None else environ
    if setting == OFF:
        return None
    if setting:
        return storage.absolute(os.path.expanduser(setting))  # where it was given, whatever the working dir later
    return environ.get(CACHE_DIR_ENV) or storage.join(get_base_dir(), CACHE_SUBDIR)


def enable_compilation_cache(setting: str | None = None) -> str | None:
    """Point JAX's persistent compilation cache where `--compilation-cache` says (cache_dir) and return that
    directory (None: off). Call it before the first compile; a later call moves the cache for later compiles."""
    path = cache_dir(setting)
    if path != jax.config.jax_compilation_cache_dir:
        compilation_cache.reset_cache()  # JAX opens the directory once, at the first compile that uses it
        jax.config.update("jax_compilation_cache_dir", path)
    if path and storage.is_url(path):
        jax.config.update(XLA_CACHES_OPTION, "none")
    return path


def add_compilation_cache_flag(parser) -> None:
    """`--compilation-cache`, as the evaluation scripts take it (scripts.train's is a RunSettings field with the
    same help)."""
    parser.add_argument("--compilation-cache", type=str, default=None, metavar="DIR|off", help=FLAG_HELP)
