"""Small things every module needs: the base directory, printing from process 0,
the device kind and its compute dtype, peak FLOP/s for MFU, a wandb stand-in."""

import functools
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from jaxchat import storage

if TYPE_CHECKING:  # (imported where used: see _process_index)
    import jax
    import jax.numpy as jnp

BASE_DIR_ENV = "JAXCHAT_BASE_DIR"
DEFAULT_BASE_DIR = os.path.join("~", ".cache", "jaxchat")
# runs/cpu_demo.sh's default (it reads it from here): apart from the default, so that the demo's
# --overwrite never replaces a GPU run's corpus, tokenizer or model
DEMO_BASE_DIR = os.path.join("~", ".cache", "jaxchat-cpu-demo")


def fail(message: str) -> NoReturn:
    """For scripts (library code raises): bad input, say what to change, exit 2, no traceback."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def error_chain(error: BaseException):
    """The error, then its causes and contexts, outermost first."""
    while error is not None:
        yield error
        error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)


def error_reason(error: BaseException) -> str:
    """One line for an error: its innermost cause (Orbax wraps tensorstore's ValueError, which says what
    is wrong with which file, in a bare Exception whose message is a page of TensorStore spec)."""
    *_, error = error_chain(error)
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else ""
    if len(text) > 300:  # tensorstore puts the path first and the reason ("No space left on device") last
        text = text[:140] + " ... " + text[-150:]
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class PlatformError(RuntimeError):
    """The backend asked for cannot start; the message says what to do."""


def select_platform(device_type: str) -> None:
    """Start the backend the user asked for, or raise PlatformError saying why it is not there."""
    if device_type not in ("", "cuda", "gpu", "cpu", "tpu"):
        hint = " (JAX has no MPS backend)" if device_type == "mps" else ""
        raise PlatformError(f"--device-type {device_type!r} is not supported{hint}: use cuda, cpu, or leave it empty "
                            "to autodetect")
    import jax

    if device_type == "cpu":
        jax.config.update("jax_platforms", "cpu")
    try:
        present = jax.default_backend()  # 'gpu', 'tpu' or 'cpu'
    except (RuntimeError, AssertionError) as e:
        raise PlatformError(f"no JAX backend could start ({e or type(e).__name__}); check $JAX_PLATFORMS, or use "
                            "--device-type=cpu") from None
    wanted = {"cuda": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(device_type)
    if wanted and present != wanted:
        extra = " Install the GPU build with `pip install -e '.[cuda12]'`." if wanted == "gpu" else ""
        raise PlatformError(f"--device-type {device_type} asked for, but no such device is present (JAX sees: "
                            f"{present}).{extra} Use --device-type=cpu, or leave it empty to autodetect.")


def get_base_dir() -> str:
    """Where tokenizer, data, checkpoints and reports live: $JAXCHAT_BASE_DIR (a local path or gs://bucket/prefix)
    or ~/.cache/jaxchat."""
    base_dir = os.environ.get(BASE_DIR_ENV) or os.path.expanduser(DEFAULT_BASE_DIR)
    if storage.is_url(base_dir):  # a bucket: nothing to make; the scheme checked
        return storage.check_supported(base_dir.rstrip("/"))
    os.makedirs(base_dir, exist_ok=True)
    return base_dir


def local_dir() -> str:
    """Where the files that this host alone writes and reads go (the CORE eval bundle, profiles, gpu_check's
    report): the base dir, or ~/.cache/jaxchat when the base dir is a bucket (those are read by local tools:
    zip, TensorBoard, the JAX profiler)."""
    base_dir = get_base_dir()
    if not storage.is_url(base_dir):
        return base_dir
    local = os.path.expanduser(DEFAULT_BASE_DIR)
    os.makedirs(local, exist_ok=True)
    return local


def base_dir_hint(missing_path: str) -> str:
    """For an error about a tokenizer, data or checkpoints missing at `missing_path`: if that path is inside
    the base directory, which base directory was looked in and how to choose another, and which other known
    base directory (the default, the CPU demo's) holds the same thing. Empty for a path given explicitly
    outside the base directory (the user chose it; no other place is implied)."""
    base_dir = storage.absolute(get_base_dir())
    source = f"from ${BASE_DIR_ENV}" if os.environ.get(BASE_DIR_ENV) else f"the default; ${BASE_DIR_ENV} sets another"
    hint = f" (looked in the base directory {base_dir}: {source})"
    if storage.is_url(base_dir) or storage.is_url(missing_path):  # no other bucket to suggest
        return hint if str(missing_path).startswith(base_dir + "/") else ""
    relative = os.path.relpath(os.path.abspath(missing_path), base_dir)
    if relative == os.pardir or relative.startswith(os.pardir + os.sep):
        return ""
    for other in (os.path.abspath(os.path.expanduser(d)) for d in (DEFAULT_BASE_DIR, DEMO_BASE_DIR)):
        candidate = os.path.join(other, relative)
        if other != base_dir and os.path.exists(candidate) and not (os.path.isdir(candidate)
                                                                     and not os.listdir(candidate)):
            hint += f"; {other} has one: prefix the command with {BASE_DIR_ENV}={other}"
    return hint


def key_name(key) -> str | int:
    """The name in one step of a jax key path: a dict key, an attribute or a sequence index."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return str(key)


def tree_nbytes(*trees) -> int:
    """Bytes of every array (or ShapeDtypeStruct) in the trees: what a checkpoint of them holds."""
    import jax

    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for tree in trees for x in jax.tree.leaves(tree))


def _process_index() -> int:
    """jax.process_index(), and 0 in a process that has not imported JAX: it cannot have started jax.distributed.
    JAX is imported where it is used, not here: the commands that never use it (the data, tokenizer and report
    commands, the CPU demo's helpers) would each spend ~2 s of CPU importing it."""
    jax = sys.modules.get("jax")
    return 0 if jax is None else jax.process_index()


def is_master() -> bool:
    """Process 0 logs, samples and writes reports. (Only call once JAX is initialised.)"""
    return _process_index() == 0


def print0(*args, **kwargs) -> None:
    if _process_index() == 0:
        print(*args, **kwargs, flush=True)


def backend() -> str:
    """'gpu', 'tpu' or 'cpu': the platform of the default devices."""
    import jax

    return jax.default_backend()


def per_process_cache(fn: Callable) -> Callable:
    """fn(*args, **model_kwargs), every argument hashable, computed once per process for each set of arguments
    and the backend, which picks the defaults that a GPT's keyword arguments leave out (compute_dtype,
    jaxchat.model.attention.default_implementation). Callers share the value kept: they copy what they change."""
    @functools.lru_cache(maxsize=32)
    def cached(platform: str, args: tuple, model_kwargs: tuple):
        return fn(*args, **dict(model_kwargs))

    @functools.wraps(fn)
    def call(*args, **model_kwargs):
        return cached(backend(), args, tuple(sorted(model_kwargs.items())))
    return call


def compute_dtype(platform: str | None = None) -> "jnp.dtype":
    """bfloat16 matmuls on accelerators; float32 on CPU, where bf16 is emulated and slower."""
    import jax.numpy as jnp

    platform = platform or backend()
    return jnp.bfloat16 if platform in ("gpu", "cuda", "rocm", "tpu") else jnp.float32


# Dense bf16 peak FLOP/s per chip (no 2:4 sparsity), matched against jax's device_kind.
# Order matters: the first substring that matches wins (so "H100 PCIe" before "H100").
PEAK_FLOPS_BF16 = [
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("A10G", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v5", 459e12),  # v5p's device_kind is "TPU v5" (v5e's "TPU v5 lite", matched above)
    ("TPU v4", 275e12),
]


def peak_flops_per_device(device: "jax.Device | None" = None) -> float | None:
    """Peak bf16 FLOP/s of one device, or None where the kind is unknown (MFU then says n/a)."""
    import jax

    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    for name, flops in PEAK_FLOPS_BF16:
        if name.lower() in kind.lower():
            return flops
    return None


class DummyWandb:
    """Stands in for a wandb run when logging is off (--run dummy, or not process 0)."""

    def log(self, *args, **kwargs) -> None:
        pass

    def finish(self) -> None:
        pass


VERBOSE_ENV = "JAXCHAT_VERBOSE"


_ORBAX_SOURCE = f"{os.sep}orbax{os.sep}"


def _through_orbax(traceback) -> bool:
    while traceback is not None:
        if _ORBAX_SOURCE in traceback.tb_frame.f_code.co_filename:
            return True
        traceback = traceback.tb_next
    return False


def _from_orbax(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for what Orbax logs of an error (through absl), and for asyncio's
    'exception was never retrieved' about the reads or writes of a step Orbax has given up on."""
    error = record.exc_info[1] if record.exc_info else None
    return not (_ORBAX_SOURCE in record.pathname or (error is not None and _through_orbax(error.__traceback__)))


def _unraisable_unless_orbax(unraisable) -> None:
    """sys.unraisablehook: drops the leftovers of a step Orbax failed to read or write (its abandoned
    coroutines, and tensorstore's callbacks into the asyncio loop Orbax has closed: a traceback per array
    in flight); the error itself reaches jaxchat.checkpoint.manager, which reports it in one line."""
    closed_loop = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
    if not (closed_loop or _through_orbax(unraisable.exc_traceback)):
        sys.__unraisablehook__(unraisable)


def quiet_jax_warnings() -> None:
    """A script prints its own lines only: the libraries' log warnings (Orbax's through absl, e.g.
    "read_only=True, setting save_interval_steps=0", JAX's, XLA's) are hidden, and so are the copies of
    Orbax's errors it logs or leaves behind (the errors themselves are raised and reported). JAXCHAT_VERBOSE=1
    leaves the libraries' logging as it is."""
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name in ("absl", "jax", "orbax"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in ("absl", "asyncio"):
        if _from_orbax not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_from_orbax)
    sys.unraisablehook = _unraisable_unless_orbax
    # Donating buffers that XLA cannot reuse (e.g. on CPU) is harmless.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


class Progress:
    """Progress of long work. On a terminal: permanent lines plus one status line redrawn in place.
    In a log (not a TTY): the status as a line at most every log_interval_s seconds, so a log shows
    rate and ETA without a line per update. Thread-safe; prints on process 0 only."""

    def __init__(self, stream=None, min_interval_s: float = 0.2, log_interval_s: float = 30.0):
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self.interval_s = min_interval_s if self.live else log_interval_s
        self.enabled = _process_index() == 0
        self.lock = threading.Lock()
        self.status_text = ""
        self.last_draw = time.monotonic() if not self.live else 0.0

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def status(self, text: str, force: bool = False) -> None:
        with self.lock:
            self.status_text = text
            now = time.monotonic()
            due = now - self.last_draw >= self.interval_s
            if not (due or (force and self.live)):  # off a terminal, forced redraws would flood the log
                return
            self._write("\r\033[K" + text if self.live else text + "\n")
            self.last_draw = now

    def line(self, text: str) -> None:
        with self.lock:
            self._write("\r\033[K" + text + "\n" + self.status_text if self.live else text + "\n")

    def close(self, final_line: str) -> None:
        with self.lock:
            self.status_text = ""
            self._write(("\r\033[K" if self.live else "") + final_line + "\n")


def eta_text(done: float, total: float, elapsed_s: float) -> str:
    """'ETA 1m23s' from the average rate so far ('ETA ?' before any progress)."""
    if done <= 0 or elapsed_s <= 0:
        return "ETA ?"
    remaining = max(total - done, 0) * elapsed_s / done
    minutes, seconds = divmod(int(remaining), 60)
    return f"ETA {minutes}m{seconds:02d}s" if minutes else f"ETA {seconds}s"


def format_table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """rows as a right-aligned text table: one column per (key, format), 'n/a' where a row has no value."""
    cells = [[fmt.format(r[name]) if r.get(name) is not None else "n/a" for name, fmt in columns] for r in rows]
    widths = [max(len(name), *(len(row[i]) for row in cells)) for i, (name, _) in enumerate(columns)]
    lines = ["  ".join(name.rjust(w) for (name, _), w in zip(columns, widths))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
