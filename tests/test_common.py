"""Progress display and the peak FLOP/s table."""

import io

import pytest

from jaxchat.common import Progress, eta_text, peak_flops_per_device


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
