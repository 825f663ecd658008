"""--profile-steps: the window's parsing, and scripts.bench's traced steps (scripts.train's are tested end to
end in test_train_script.py)."""

import gzip
import json

import pytest

from jaxchat.train.profiling import ProfileStepsError, parse_profile_steps, trace_files


def test_a_window_is_a_python_slice_of_steps():
    assert parse_profile_steps("20:25") == (20, 25)
    assert parse_profile_steps("7") == (7, 8)
    for bad in ("5:5", "5:2", "-1:3", "a:b", "1:2:3", ""):
        with pytest.raises(ProfileStepsError, match="give A:B, the steps A..B-1 to trace"):
            parse_profile_steps(bad)


def test_bench_traces_steps_after_its_timed_ones(tmp_path, capsys):
    """One trace per row, its steps annotated with the window's numbers; the table's times are untraced."""
    from scripts import bench

    bench.main(["train", "--depth", "2", "--max-seq-len", "64", "--device-batch-size", "1", "--vocab-size", "256",
                "--steps", "1", "--num-devices", "1", "--profile-steps", "3:5",
                "--profile-dir", str(tmp_path)])
    trace_dir = tmp_path / "d2_SSSL_auto"
    assert f"Profile of steps 3..4 in {trace_dir}" in capsys.readouterr().out
    perfetto = [f for f in trace_files(str(trace_dir)) if f.endswith("perfetto_trace.json.gz")]
    with gzip.open(perfetto[0]) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    assert sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train") == [3, 4]
