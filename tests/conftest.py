"""Every test runs on the CPU with 8 virtual devices, so multi-device code is tested
without a GPU. Must run before JAX is imported anywhere. Also the fixtures several test files share: the
built-in corpus and a user's base dir, subprocesses of JAX (scripts.train, workers). The float64 NumPy
versions of nanochat's maths are tests/nanochat_numpy.py."""

import os
import socket
import shutil
import subprocess
import sys
import tempfile
import threading

# XLA:CPU compiling fast rather than well: the suite compiles ~2,000 small programs (eager ops, one step or
# forward each) and runs each a few times, so compiling is most of its time.
# - LLVM at -O0 for the code XLA emits: ~1.5x as fast (tests/test_gpt_92d63d4.py and test_engine.py: 45 s of
#   compilation down to 26 s, on 2 cores).
# - XLA:CPU's IR emitters rather than its MLIR fusion emitters, and LLVM's module in one piece rather than split
#   for parallel codegen: a d2 train step (8 devices, remat dots) compiled in 0.8 s instead of 1.8 s; the whole
#   suite took 276 s instead of 382 s, 514 CPU-seconds instead of 787 (2-core VM, 2026-12-07).
# XLA's optimised HLO and its memory analysis stay the same (a d2 train step's, compared: its temporaries
# 64 bytes apart in 5.8 MiB); the machine code runs slower and may round differently (-O0 alone: a d2 run's loss
# after 3 steps the same on 1 device, 7e-7 apart relative on 8), within every tolerance here, which is derived
# from float32 rounding, not from one compiler's bits. Subprocesses that run JAX inherit it (subprocess_env).
# An XLA flag that this jaxlib does not know aborts every JAX process ("Unknown flag in XLA_FLAGS"): the two
# XLA:CPU flags are checked once per session (a process that starts the CPU backend with them, ~1 s), by the
# controller; its workers and subprocesses inherit the answer.
def _fast_compile_xla_flags() -> str:
    optional = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
    probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": optional})
    return "--xla_backend_optimization_level=0" + (f" {optional}" if probe.returncode == 0 else "")


if "JAXCHAT_TEST_FAST_COMPILE_XLA_FLAGS" not in os.environ:
    os.environ["JAXCHAT_TEST_FAST_COMPILE_XLA_FLAGS"] = _fast_compile_xla_flags()
FAST_COMPILE_XLA_FLAGS = os.environ["JAXCHAT_TEST_FAST_COMPILE_XLA_FLAGS"]


def host_xla_flags(devices: int) -> str:
    """XLA_FLAGS of a JAX process standing for a host of `devices` CPU devices, compiling as the suite does
    (a subprocess given its own XLA_FLAGS would otherwise lose these)."""
    return f"{FAST_COMPILE_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"


os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), host_xla_flags(8)]).strip()
os.environ.setdefault("WANDB_MODE", "disabled")
# A folder for the session's shared files, made by the controller (pytest-xdist's workers inherit the variable,
# set before they start) and removed with the session: the built-in corpus (builtin_docs) and, unless the caller
# names its own, one persistent XLA compilation cache for this process, the workers and every JAX process a test
# starts (subprocess_env). Tests compile the same programs more than once: a train step per in-process run of
# scripts.train, a script's programs at each start. Programs that compile in under 0.2 s (an eager operation:
# ~0.05 s) are not written.
if "JAXCHAT_TEST_SESSION_DIR" not in os.environ:
    os.environ["JAXCHAT_TEST_SESSION_DIR"] = tempfile.mkdtemp(prefix="jaxchat-tests-")
SESSION_DIR = os.environ["JAXCHAT_TEST_SESSION_DIR"]
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(SESSION_DIR, "xla_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import re  # noqa: E402

import pytest  # noqa: E402
from gcs_server import gcs, gcs_server  # noqa: E402,F401  (the gs:// fixtures: fake-gcs-server)

# scripts.train's printed lines, as the end-to-end tests read them: a step's loss, and an evaluation's bpb
TRAIN_STEP_LINE = re.compile(r"^step (\d+)/\d+ .*?\| loss: ([\d.]+) \|", re.M)
VAL_BPB_LINE = re.compile(r"^Step (\d+) \| Validation bpb: ([\d.]+)$", re.M)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def builtin_docs() -> list[str]:
    """The built-in corpus (local_corpus.builtin_documents() at its defaults: the docstrings of Python's standard
    library), parsed once per session, by the first worker that asks (~4 CPU-seconds); the others read its file."""
    import fcntl
    import json

    from jaxchat.data import local_corpus

    path = os.path.join(SESSION_DIR, "builtin_documents.json")
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(path):
            with open(path + ".part", "w") as f:
                json.dump(local_corpus.builtin_documents(), f)
            os.replace(path + ".part", path)
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def make_base_dir(builtin_docs):
    """make(path) fills path as a user's base dir after `python -m jaxchat.dataset --builtin` and
    `python -m scripts.tok_train`: six small shards of the first 300 built-in documents, each cut to its first
    600 characters (row groups of 8), and a 512-token tokenizer trained on them. Short documents: a loader
    fills nanochat's best-fit buffer (1000 documents) before its first row, going round its share of this
    small corpus several times: with the documents whole (3,000 characters on average) every loader of a
    test run tokenised ~3 M characters (the two-host pairs alone: 74 CPU-seconds, 70 with these)."""

    def make(path):
        from jaxchat.data import local_corpus
        from jaxchat.data.tokenizer import Tokenizer

        documents = [doc[:600] for doc in builtin_docs[:300]]
        chars_per_shard = sum(map(len, documents)) // 6 + 1
        local_corpus.write_shards(lambda: documents, str(path / "base_data"), chars_per_shard=chars_per_shard,
                                  docs_per_row_group=8)
        Tokenizer.train_from_iterator(iter(documents), vocab_size=512).save(str(path / "tokenizer"))
        return path

    return make


# .ci/run runs the `cuda_plugin` and `tpu_plugin` tests again once the cuda12 / tpu extra is installed, with
# these set to 1: there a missing plugin fails them instead of skipping, so the compiled-accelerator claims
# they check cannot go unchecked
REQUIRE_CUDA_PLUGIN_ENV = "JAXCHAT_REQUIRE_CUDA_PLUGIN"
REQUIRE_TPU_PLUGIN_ENV = "JAXCHAT_REQUIRE_TPU_PLUGIN"


def _libtpu_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def _cuda_plugin_installed() -> bool:
    from jaxchat.distributed.runtime import cuda_plugin_installed

    return cuda_plugin_installed()


PLUGIN_MARKERS = {  # marker: (is it installed, what to say, the variable that makes a missing one fail)
    "cuda_plugin": (_cuda_plugin_installed, "needs JAX's CUDA plugin to compile for an H100 target: "
                    "pip install -e '.[cuda12]'", REQUIRE_CUDA_PLUGIN_ENV),
    "tpu_plugin": (_libtpu_installed, "needs libtpu to compile for a TPU target: pip install -e '.[tpu]'",
                   REQUIRE_TPU_PLUGIN_ENV),
}


def pytest_runtest_setup(item):
    """A test marked cuda_plugin (tpu_plugin) compiles for an H100 (a TPU) target: skipped without the plugin."""
    for marker, (installed, message, require_env) in PLUGIN_MARKERS.items():
        if item.get_closest_marker(marker) is None or installed():
            continue
        if os.environ.get(require_env) == "1":
            pytest.fail(f"{message} (${require_env}=1 asks for these tests to run)")
        pytest.skip(message)


def pytest_sessionfinish(session):
    """The session's folder goes with it (by the controller, once its workers are done)."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def subprocess_env():
    """env(**overrides) -> the environment for a subprocess that runs JAX (a script, a worker): this
    process's (so the session's compilation cache), unbuffered, every program written to the cache. Compiling
    is most of a short run's time: a run resumed later, or any run of the same program, loads it instead."""

    def env(**overrides: str) -> dict[str, str]:
        return {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0", **overrides}

    return env


@pytest.fixture(scope="session")
def free_port():
    """free_port() -> a TCP port of 127.0.0.1 that nothing listens on (a coordinator's, or a refused download's)."""

    def pick() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    return pick


@pytest.fixture(scope="session")
def start_train(subprocess_env):
    """start_train(base_dir, *flags, **env) -> the Popen of `python -m scripts.train *flags` as a user
    starts it on base_dir (JAXCHAT_BASE_DIR), from the repository root; its output (stderr merged into
    stdout, as on a terminal) is a text pipe."""

    def start(base_dir, *flags: str, **env: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "scripts.train", *flags], cwd=REPO_ROOT,
                                env=subprocess_env(JAXCHAT_BASE_DIR=str(base_dir), **env),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    return start


@pytest.fixture(scope="session")
def rest_of_output():
    """rest_of_output(process, timeout) -> what a started process prints from here until it exits (killed after
    timeout seconds), for a stdout already read from line by line. Not communicate(timeout=...): it reads the
    pipe under the text stream, and loses the lines that the stream has read ahead but not yet returned."""

    def rest(process: subprocess.Popen, timeout: float) -> str:
        watchdog = threading.Timer(timeout, process.kill)
        watchdog.start()
        try:
            out = process.stdout.read()
            process.wait()
        finally:
            watchdog.cancel()
        return out

    return rest
