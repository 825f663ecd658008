"""Progress display, the peak FLOP/s table, the libraries kept quiet, what a process keeps of its traces, and how it
exits."""

import io
import logging
import os
import subprocess
import sys

import pytest

from jaxchat.common import (VERBOSE_ENV, Progress, eta_text, peak_flops_per_device, per_process_cache,
                            quiet_jax_warnings)


class FakeDevice:
    def __init__(self, kind):
        self.device_kind = kind


def test_progress_in_a_log_prints_status_only_every_interval(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("jaxchat.common.time.monotonic", lambda: clock[0])
    log = io.StringIO()  # not a TTY
    progress = Progress(stream=log, log_interval_s=30)
    progress.line("start")
    for i in range(100):  # a burst of updates, forced or not: no line yet
        progress.status(f"{i}/100", force=i % 2 == 0)
    clock[0] += 31
    progress.status("100/200")
    progress.status("101/200")  # within the next interval: dropped
    progress.close("done")
    assert log.getvalue().splitlines() == ["start", "100/200", "done"]
    assert "\r" not in log.getvalue() and "\033" not in log.getvalue()


def test_eta_text():
    assert eta_text(0, 10, 5.0) == "ETA ?"
    assert eta_text(5, 10, 5.0) == "ETA 5s"
    assert eta_text(1, 100, 10.0) == "ETA 16m30s"


@pytest.mark.parametrize("kind, flops", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                                         ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                         ("cpu", None)])
def test_peak_flops_table(kind, flops):
    assert peak_flops_per_device(FakeDevice(kind)) == flops


def test_quiet_libraries_leave_one_line_per_error(monkeypatch, capsys):
    """A script's own error line stands alone: what Orbax logs of an error it raises, what it leaves behind
    (abandoned coroutines of a damaged step's reads, asyncio's 'exception was never retrieved' about them,
    tensorstore's 'Event loop is closed' after a failed save) is dropped; other errors still show."""
    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # restored after the test
    for name in ("absl", "asyncio"):
        monkeypatch.setattr(logging.getLogger(name), "filters", list(logging.getLogger(name).filters))
    quiet_jax_warnings()
    orbax_file = os.path.join(os.sep, "site-packages", "orbax", "checkpoint", "serialization.py")

    def raised_in(filename: str) -> BaseException:
        try:
            exec(compile("raise Exception('Encountered error while reading array index')", filename, "exec"))
        except Exception as e:  # noqa: BLE001
            return e

    def record(logger: str, pathname: str, error: BaseException | None = None) -> logging.LogRecord:
        exc_info = (type(error), error, error.__traceback__) if error else None
        return logging.LogRecord(logger, logging.ERROR, pathname, 1, "failed", None, exc_info)

    asyncio_file = os.path.join(os.sep, "lib", "asyncio", "base_events.py")
    assert not logging.getLogger("absl").filter(record("absl", orbax_file))
    assert not logging.getLogger("asyncio").filter(record("asyncio", asyncio_file, raised_in(orbax_file)))
    assert logging.getLogger("asyncio").filter(record("asyncio", asyncio_file, raised_in("mine.py")))
    assert logging.getLogger("absl").filter(record("absl", os.path.join("jaxchat", "checkpoint.py")))

    class RaisesWhenCollected:  # an unraisable error, as an abandoned coroutine or a late callback makes one
        def __init__(self, error: BaseException):
            self.error = error

        def __del__(self):
            raise self.error

    RaisesWhenCollected(RuntimeError("Event loop is closed"))
    RaisesWhenCollected(raised_in(orbax_file))
    assert capsys.readouterr().err == ""
    RaisesWhenCollected(ValueError("something else"))
    assert "ValueError: something else" in capsys.readouterr().err


def test_a_missing_tokenizer_data_or_model_names_the_base_dir_and_the_one_that_has_it(tmp_path, monkeypatch):
    """After the CPU demo (its own base directory), the other commands look in the default one: each error says
    where it looked, that $JAXCHAT_BASE_DIR chooses, and the prefix that finds the demo's."""
    from jaxchat.checkpoint.meta import NoCheckpointError
    from jaxchat.checkpoint.run_directory import find_model_tag
    from jaxchat.data.shards import parquet_paths_for_split
    from jaxchat.data.tokenizer import get_token_bytes, get_tokenizer

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JAXCHAT_BASE_DIR", raising=False)
    default, demo = tmp_path / ".cache" / "jaxchat", tmp_path / ".cache" / "jaxchat-cpu-demo"
    looked = f"(looked in the base directory {default}: the default; $JAXCHAT_BASE_DIR sets another)"
    found = f"; {demo} has one: prefix the command with JAXCHAT_BASE_DIR={demo}"
    missing = [(FileNotFoundError, get_tokenizer), (FileNotFoundError, get_token_bytes),
               (FileNotFoundError, lambda: parquet_paths_for_split("train")),
               (NoCheckpointError, lambda: find_model_tag(str(default / "base_checkpoints")))]
    for error, call in missing:  # nothing anywhere: where it looked, no other place
        with pytest.raises(error) as info:
            call()
        assert looked in str(info.value) and "has one" not in str(info.value), str(info.value)

    for relative in ("tokenizer/tokenizer.tiktoken", "tokenizer/token_bytes.npy", "base_data/shard_00000.parquet",
                     "base_checkpoints/d2/40/meta"):
        (demo / relative).parent.mkdir(parents=True, exist_ok=True)
        (demo / relative).write_bytes(b"")
    for error, call in missing:
        with pytest.raises(error) as info:
            call()
        assert looked + found in str(info.value), str(info.value)

    # from a base directory of one's own (the default then has one too), and a path the user gave outside the base directory gets no hint
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path / "chosen"))
    (default / "base_checkpoints" / "d4").mkdir(parents=True)
    with pytest.raises(NoCheckpointError, match=f"from \\$JAXCHAT_BASE_DIR\\); {default} has one: prefix the "):
        find_model_tag(str(tmp_path / "chosen" / "base_checkpoints"))
    with pytest.raises(FileNotFoundError) as info:
        get_tokenizer(str(tmp_path / "mine"))
    assert str(info.value) == (f"no tokenizer at {tmp_path / 'mine'} (tokenizer.tiktoken is missing); "
                               "train one with `python -m scripts.tok_train`")


def test_per_process_cache_computes_once_per_arguments_and_backend(monkeypatch):
    """The backend is part of the key: it picks the defaults of what the arguments leave out (a GPT's dtype)."""
    calls = []

    @per_process_cache
    def scaled_square(x, *, scale=1):
        calls.append((x, scale))
        return x * x * scale

    assert scaled_square(3) == scaled_square(3) == 9 and scaled_square(3, scale=2) == 18
    monkeypatch.setattr("jaxchat.common.backend", lambda: "gpu")
    assert scaled_square(3) == 9
    assert calls == [(3, 1), (3, 2), (3, 1)]


@pytest.mark.slow
def test_a_process_that_imported_jaxchat_ends_with_its_objects_frozen():
    """The package's exit handler runs after those registered before it was imported: by then gc.freeze() has moved
    every object to the permanent generation (jaxchat/__init__.py), which the final collections skip."""
    probe = ("import atexit, gc; atexit.register(lambda: print(gc.get_freeze_count() > 0)); "
             "print(gc.get_freeze_count() > 0); import jaxchat")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "True"], done.stdout + done.stderr
