"""The report card: sections as the stages write them, the summary table pulled from them, the training
curve (one per model tag: a CSV that survives a resume, PNG drawn from it), the system section, and the command
line.
(scripts.train writing the curve across a real resume: test_checkpoint.py's end-to-end runs.)"""

import csv
import json
import os
import re
import subprocess
import sys

import jax
import matplotlib.image
import numpy as np
import pytest

from jaxchat import report, storage

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def summary_table(markdown: str) -> dict[str, str]:
    """The rows of report.md's summary table."""
    summary = markdown.split("## Summary", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (.+?) \| (.+?) \|$", summary, re.M)
            if m.group(1) not in ("figure", "---")}


def log_stages(r: report.Report) -> None:
    """Sections shaped as tok_train, scripts.train and base_loss write them, newest stage first on disk."""
    r.log("Base model loss", [{"Model": "d4 step 120", "train bpb": 1.9876543, "val bpb": 2.0123456,
                               "sample 0": "The capital of France is\n\nthe city"}])
    r.log("Base model training", [
        {"depth": 4, "total_batch_size": 4096},
        {"Number of parameters": 7340040, "Devices": "1 x cpu", "Tokens : Params ratio": 0.0669643},
        {"Minimum validation bpb": np.float32(2.04344), "CORE metric estimate": None, "MFU %": "n/a",
         "Total training time": "4.10m", "Average tok/sec": 1998},
    ])
    r.log("Tokenizer training", [{"vocab_size": 8192}, {"Vocabulary size": 8192, "Training time": "1.50s"}])


def test_sections_and_summary_carry_the_logged_values(tmp_path):
    r = report.Report(str(tmp_path))
    log_stages(r)
    training = (tmp_path / "base-model-training.md").read_text()
    assert training.startswith("## Base model training\ntimestamp: ")
    assert "- Number of parameters: 7,340,040\n" in training and "- total_batch_size: 4,096\n" in training
    assert "- Minimum validation bpb: 2.04344\n" in training  # a NumPy scalar, shown as the number it holds
    # ... and recorded as that number (float32(2.04344) is within half an ulp of 2, 1.2e-7, of it)
    recorded = json.loads((tmp_path / "base-model-training.json").read_text())["data"][2]["Minimum validation bpb"]
    assert isinstance(recorded, float) and abs(recorded - 2.04344) < 2e-7
    # a multi-line value becomes a fenced block under its item, not a broken list
    loss = (tmp_path / "base-model-loss.md").read_text()
    assert "- sample 0:\n  ```\n  The capital of France is\n  \n  the city\n  ```" in loss
    # the same data as a JSON record, from which the summary is built: numbers stay numbers
    record = json.loads((tmp_path / "base-model-loss.json").read_text())
    assert record["section"] == "Base model loss" and loss.startswith(f"## Base model loss\ntimestamp: {record['timestamp']}\n")
    assert record["data"] == [{"Model": "d4 step 120", "train bpb": 1.9876543, "val bpb": 2.0123456,
                               "sample 0": "The capital of France is\n\nthe city"}]

    path = r.generate()
    text = open(path).read()
    assert summary_table(text) == {
        "Vocabulary size": "8,192", "Parameters": "7,340,040", "Devices": "1 x cpu", "Tokens : params": "0.0669643",
        "Training time": "4.10m",
        "Training tok/s": "1,998", "Min val bpb (training)": "2.04344", "Train bpb": "1.98765", "Val bpb": "2.01235",
    }  # the CORE estimate (None) and MFU (n/a) were not measured and are left out; no reset, no wall clock
    # stages in run order, whatever order their files were written in
    order = [text.index(f"## {name}") for name in ("Summary", "System", "Tokenizer training", "Base model training",
                                                   "Base model loss")]
    assert order == sorted(order)
    assert "(no `python -m jaxchat.report reset` before this run: taken now)" in text
    assert "training_curve" not in text  # nothing was logged to a curve


def test_curve_last_row_of_a_step_wins_and_plot_shows_both_series(tmp_path):
    r = report.Report(str(tmp_path), "d4")
    r.append_curve([(0, None, 3.1), (0, 9.0, None), (1, 8.5, None), (2, 8.0, None), (2, None, 2.9)])
    # a resume from step 1: steps 1 and 2 again (as an exact resume would give), then onwards
    r.append_curve([(1, 8.5, None), (2, 8.0, None), (2, None, 2.9), (3, 7.0, None), (4, 6.5, None), (4, None, 2.5)])
    r.append_curve([])
    with open(tmp_path / "training_curve_d4.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss", "val_bpb"] and len(rows) == 1 + 11
    assert rows[1] == ["0", "", "3.100000"]
    train, val = r.read_curve("d4")
    assert train == {0: 9.0, 1: 8.5, 2: 8.0, 3: 7.0, 4: 6.5}
    assert val == {0: 3.1, 2: 2.9, 4: 2.5}

    png = r.plot_curve("d4")
    assert png == str(tmp_path / "training_curve_d4.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)[..., :3]
    assert image.shape == (440, 1210, 3)  # 11 x 4 inches at 110 dpi
    # both lines are drawn: pixels of matplotlib's tab:blue (loss) and tab:orange (bpb)
    for rgb in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert (np.abs(image * 255 - np.array(rgb)).max(axis=-1) < 8).sum() > 200, rgb

    r.clear_curve()
    assert not os.path.exists(tmp_path / "training_curve_d4.csv") and not os.path.exists(png)
    assert r.read_curve("d4") == ({}, {}) and r.plot_curve("d4") is None


def curve_steps(r: report.Report, model_tag: str) -> list[int]:
    return list(r.read_curve(model_tag)[0])


def test_each_run_has_its_own_curve_and_the_report_draws_the_trained_ones(tmp_path):
    """A run preempted at step 2 ('long'), a fresh run under another tag ('probe'), then 'long' resumed: the
    fresh run does not clear the preempted run's curve, and the report draws the curve of the run whose base
    training section it shows."""
    long, probe = report.Report(str(tmp_path), "long"), report.Report(str(tmp_path), "probe")
    long.clear_curve()  # scripts.train, as a fresh run starts
    long.append_curve([(0, 9.0, 3.0), (1, 8.0, None), (2, 7.5, 2.8)])
    probe.clear_curve()
    probe.append_curve([(0, 9.9, 3.3), (1, 9.8, None)])
    probe.log(report.Section.BASE_TRAINING, [{"Number of parameters": 10}])
    assert "![training loss and validation bpb of probe](training_curve_probe.png)" in open(probe.generate()).read()
    long.append_curve([(2, 7.5, 2.8), (3, 7.0, None), (4, 6.5, 2.5)])  # resumed from step 2: no clear
    long.log(report.Section.BASE_TRAINING, [{"Number of parameters": 20}])
    assert curve_steps(long, "long") == [0, 1, 2, 3, 4] and long.read_curve("long")[0][1] == 8.0
    assert curve_steps(long, "probe") == [0, 1]
    text = open(report.Report(str(tmp_path)).generate()).read()  # `report generate`: no model tag of its own
    assert "![training loss and validation bpb of long](training_curve_long.png)" in text
    assert "training_curve_probe" not in text and summary_table(text)["Parameters"] == "20"
    assert (matplotlib.image.imread(tmp_path / "training_curve_long.png").shape == (440, 1210, 4))
    with pytest.raises(ValueError, match="only a run's report has a curve"):
        report.Report(str(tmp_path)).append_curve([(0, 1.0, None)])


def test_reset_writes_the_system_section_and_clears_the_last_run(tmp_path):
    r = report.Report(str(tmp_path), "d4")
    log_stages(r)
    r.append_curve([(0, 9.0, 3.0)])
    report.Report(str(tmp_path), "other").append_curve([(0, 9.0, 3.0)])
    r.generate()
    r.reset()
    assert sorted(os.listdir(tmp_path)) == ["system.json", "system.md"]
    header = (tmp_path / "system.md").read_text()
    fields = json.loads((tmp_path / "system.json").read_text())["data"][0]
    assert dict(re.findall(r"^- ([^:]+): (.+)$", header, re.M)) == fields
    assert re.search(r"^timestamp: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", header, re.M)
    assert f"jax {jax.__version__}" in fields["Packages"]
    assert fields["Devices"] == f"{jax.device_count()} x cpu"  # conftest's 8 virtual CPU devices
    assert fields["JAX backend"] == "cpu, 1 process(es)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert fields["Git commit"].split()[0] == commit.stdout.strip()
    assert fields["Python"] == ".".join(map(str, sys.version_info[:3]))

    # after a reset, the report measures the wall clock from it to the newest section
    r.log("Base model training", [{"Number of parameters": 10}])
    assert re.fullmatch(r"0:00:0\d", summary_table(open(r.generate()).read())["Wall clock, reset to last stage"])


def test_command_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXCHAT_BASE_DIR", str(tmp_path))
    report.main(["reset"])
    log_stages(report.get_report(model_tag="d4"))
    report.get_report(model_tag="d4").append_curve([(0, 9.0, 3.0), (1, 8.0, None), (2, 7.5, 2.8)])
    report.main([])  # generate is the default
    out = capsys.readouterr().out
    assert re.search(r"^Val bpb +2\.01235$", out, re.M)
    assert f"Report written to {tmp_path / 'report' / 'report.md'}" in out
    text = (tmp_path / "report" / "report.md").read_text()
    assert "![training loss and validation bpb of d4](training_curve_d4.png)" in text
    assert os.path.getsize(tmp_path / "report" / "training_curve_d4.png") > 0
    with pytest.raises(SystemExit):
        report.main(["publish"])


def test_a_report_in_a_bucket_and_a_requeued_jobs_reset_keeps_it(gcs, monkeypatch, capsys):
    """runs/multihost_slurm.sh starts every job with `reset --keep`: the first start of a job makes the report, a
    requeued start keeps it. In a bucket (fake-gcs-server): sections, curve (appended by rewriting its object),
    report.md and the curve's image all there."""
    monkeypatch.setenv("JAXCHAT_BASE_DIR", gcs)
    report.main(["reset", "--keep"])
    log_stages(report.get_report(model_tag="d4"))
    report.get_report(model_tag="d4").append_curve([(0, 9.0, 3.0)])
    report.get_report(model_tag="d4").append_curve([(1, 8.0, None), (2, 7.5, 2.8)])
    report.main(["reset", "--keep"])
    assert "kept (started earlier)" in capsys.readouterr().out
    report.main([])
    assert re.search(r"^Val bpb +2\.01235$", capsys.readouterr().out, re.M)
    folder = storage.join(gcs, "report")
    assert storage.read_text(storage.join(folder, "training_curve_d4.csv")).splitlines() == \
        ["step,train_loss,val_bpb", "0,9.000000,3.000000", "1,8.000000,", "2,7.500000,2.800000"]
    assert storage.read_bytes(storage.join(folder, "training_curve_d4.png")).startswith(b"\x89PNG")
    assert "![training loss and validation bpb of d4]" in storage.read_text(storage.join(folder, "report.md"))
