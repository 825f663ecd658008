"""scripts.gpu_check on the CPU: it refuses without a GPU, and with --allow-cpu it runs the d2 versions of
its measurements for real: one process each, the report rewritten after each, cuDNN's failure recorded
and the rest still measured, and what does not fit the budget skipped."""

import argparse
import gzip
import json
import os
import subprocess
import sys
import time

import pytest

from scripts.gpu_check import ITEMS, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "scripts.gpu_check", *args]


@pytest.fixture
def environment(subprocess_env) -> dict:
    """The session's subprocess environment (its compilation cache), on the CPU."""
    return subprocess_env(PYTHONPATH=REPO, JAX_PLATFORMS="cpu")


def run_main(*args: str) -> int:
    """scripts.gpu_check's main(args) in this process, its exit status: a refusal, or a run that skips every
    measurement, starts no measurement here (the environment's is a child process, as always)."""
    with pytest.raises(SystemExit) as stopped:
        main(list(args))
    return stopped.value.code


def test_refuses_without_a_gpu(tmp_path, capsys):
    report = tmp_path / "gpu.json"
    assert run_main("--json", str(report)) == 2
    err = capsys.readouterr().err
    assert "no GPU" in err and "--allow-cpu" in err
    assert not report.exists()


@pytest.mark.slow
def test_every_measurement_on_the_cpu(tmp_path, environment):
    report = tmp_path / "gpu.json"
    run = subprocess.Popen(command("--allow-cpu", "--json", str(report), "--steps", "2"), cwd=REPO,
                           env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []  # the number of measurements in the report each time it is read during the run
    while run.poll() is None:
        if report.exists():
            seen.append(len(json.loads(report.read_text())["items"]))  # always whole JSON: replaced, never rewritten
        time.sleep(0.05)
    out, err = run.communicate()
    final = json.loads(report.read_text())
    items = {item["name"]: item for item in final["items"]}
    assert [item["name"] for item in final["items"]] == [item.name for item in ITEMS], out + err
    # the report was there, and growing, before the run ended: a run cut short keeps what it measured
    assert any(0 < n < len(ITEMS) for n in seen) and seen == sorted(seen)

    # no cuDNN on a CPU: that measurement fails, is recorded, and the ones after it still run
    assert run.returncode == 1
    assert items["attention"]["status"] == "failed" and "cuDNN" in items["attention"]["error"]
    for name in ("environment", "memory_d20", "step_d20", "windows_d12", "flags_off"):
        assert items[name]["status"] == "ok", items[name].get("error")
    assert items["environment"]["result"]["backend"] == "cpu"

    memory = items["memory_d20"]["result"]
    # the d2 step's state is in what XLA says it needs: its float32 parameters, counted by hand
    # (vocabulary 1024 x width 128 for wte and lm_head, 12 x 128^2 per block, 2 lambdas per block)
    depth, width, vocab = 2, 128, 1024
    assert memory["needed_gib"] * 2**30 >= 4 * (2 * vocab * width + depth * (12 * width**2 + 2))
    assert memory["float32_logits_sized"] == []  # the loss head works in chunks
    with gzip.open(tmp_path / memory["hlo"], "rt") as f:  # the optimised HLO, next to the report
        assert f.read().startswith("HloModule")
    step = items["step_d20"]["result"]  # one step of 2 rows of 256 tokens on one device, in step_ms
    assert step["tok_per_s"] == pytest.approx(2 * 256 / (step["step_ms"] / 1e3), rel=1e-12)
    rows = items["windows_d12"]["result"]["rows"]
    assert [row["config"].split()[4] for row in rows] == ["SSSL", "L"]  # "d12 T.. B.. V.. <pattern> remat=.."
    # the measurements ran with jaxchat's GPU flags, flags_off without them
    assert "xla_gpu_enable_latency_hiding_scheduler" in items["environment"]["result"]["xla_flags"]
    assert "xla_gpu_enable_latency_hiding_scheduler" not in items["flags_off"]["result"]["xla_flags"]
    assert items["flags_off"]["result"]["defaults_speedup"] == rows[0]["tok_per_s"] / items["flags_off"]["result"]["tok_per_s"]


@pytest.mark.slow
def test_what_does_not_fit_the_budget_is_skipped(tmp_path):
    """The driver in this process (it skips both measurements), the environment in its child process."""
    report = tmp_path / "reports" / "gpu.json"  # in a folder not yet made: the script makes it
    assert run_main("--allow-cpu", "--json", str(report), "--budget-s", "1", "--only", "memory_d20", "step_d20") == 0
    items = json.loads(report.read_text())["items"]
    assert [(item["name"], item["status"]) for item in items] == [
        ("environment", "ok"), ("memory_d20", "skipped"), ("step_d20", "skipped")]
    assert "budget left" in items[1]["error"]


def test_a_report_folder_that_cannot_be_made_gets_one_line(tmp_path, capsys):
    """In this process: main stops before measuring anything (a file stands where the folder would be)."""
    (tmp_path / "reports").write_text("not a folder")
    assert run_main("--allow-cpu", "--json", str(tmp_path / "reports" / "gpu.json")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --json ") and "is a file, not a directory" in err and err.count("\n") == 1, err


def test_reports_go_under_the_base_dir_one_per_target(tmp_path, monkeypatch):
    """Without --json: not the current directory (a checkout's root), and a TPU compile never replaces an H100
    one's files (the HLO files are named after the report)."""
    from scripts.gpu_check import default_report_path

    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    paths = {default_report_path(argparse.Namespace(compile_only=compile_only, target=target))
             for compile_only, target in [(True, "h100"), (True, "v6e:2x4"), (True, "v5e:4x8"), (False, "h100")]}
    assert paths == {str(tmp_path / "gpu_check" / name) for name in
                     ("compile_only_h100.json", "compile_only_v6e-2x4.json", "compile_only_v5e-4x8.json", "gpu_check.json")}


def test_compile_only_says_what_to_install(tmp_path, capsys):
    from jaxchat.distributed.runtime import cuda_plugin_installed

    if cuda_plugin_installed():
        pytest.skip("JAX's CUDA plugin is installed here: test_compile_only_for_h100s runs instead")
    assert run_main("--compile-only", "--depth", "2", "--json", str(tmp_path / "c.json")) == 2
    err = capsys.readouterr().err
    assert "cuda12" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.cuda_plugin
def test_compile_only_for_h100s(tmp_path, environment):
    """The d2 step compiled for 1 and 2 H100s (no GPU): one report each, with cuDNN attention run once
    forward and once backward per layer (--remat dots keeps its results), the first layer's short window
    (T/2 = 128, which XLA counts with the diagonal: 129) and the last layer's full context (0), and
    ZeRO-1's collectives on 2 devices counted by hand."""
    report = tmp_path / "c.json"
    done = subprocess.run(command("--compile-only", "--depth", "2", "--max-seq-len", "256", "--device-batch-size", "2",
                                  "--vocab-size", "1024", "--devices", "1", "2", "--remat", "dots", "--json", str(report)),
                          cwd=REPO, env=environment, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reports = json.loads(report.read_text())["reports"]
    assert [r["devices"] for r in reports] == [1, 2]
    for r in reports:
        assert r["kernels"]["attention"] == [{"direction": d, "window": w, "count": 1}
                                             for d in ("backward", "forward") for w in (0, 129)]
        assert r["memory_gib"]["peak"] < r["pool_gib"]
        with gzip.open(r["hlo_file"], "rt") as f:
            assert f.read().startswith("HloModule")
    width, vocab, depth = 128, 1024, 2
    matrices = 4 * (2 * vocab * width + depth * 12 * width**2)  # float32 bytes of every weight matrix
    rows = {row["kind"]: row for row in reports[1]["collectives"]}
    assert rows["reduce-scatter"]["size_gib"] * 2**30 == matrices  # the gradients, whole, once
    assert rows["all-gather"]["size_gib"] * 2**30 == matrices  # the new parameters, once
