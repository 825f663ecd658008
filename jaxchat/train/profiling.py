"""Profiles of chosen train steps: `--profile-steps A:B` (scripts.train, scripts.bench train) traces steps
A..B-1 with jax.profiler, each step under a StepTraceAnnotation, on any backend (XLA:CPU's thunks, XLA:GPU's
kernels, the host's Python and dispatch).

What a trace directory holds (jax.profiler.start_trace): plugins/profile/<run>/<host>.xplane.pb, read by
XProf (`pip install xprof; xprof --logdir DIR`, or TensorBoard with tensorboard-plugin-profile: its Trace
Viewer, per-op statistics and step times come from the step annotations), and <host>.trace.json.gz /
perfetto_trace.json.gz, which https://ui.perfetto.dev opens in the browser.

The trace stops only after the traced steps have finished on the device (one wait, after step B-1), so
the device's work is in it; steps outside A..B-1 run untraced and unsynchronised as always.
"""

import contextlib
import glob
import os
from typing import Iterator

import jax

from jaxchat.common import print0


class ProfileStepsError(ValueError):
    """A --profile-steps value that names no steps; the message says the form."""


def parse_profile_steps(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B): steps A..B-1, as a Python slice (0 is the first step this run takes). 'A' alone
    is A:A+1."""
    parts = text.split(":")
    try:
        start, stop = (int(parts[0]), int(parts[0]) + 1) if len(parts) == 1 else map(int, parts)
    except ValueError:
        start = stop = None
    if len(parts) > 2 or start is None or not 0 <= start < stop:
        raise ProfileStepsError(f"--profile-steps {text!r}: give A:B, the steps A..B-1 to trace with 0 <= A < B "
                                "(e.g. 20:25 traces five steps after compilation and warm-up)")
    return start, stop


def trace_files(trace_dir: str) -> list[str]:
    """The files a finished trace left in trace_dir: XProf's .xplane.pb and Perfetto's .json.gz."""
    pattern = os.path.join(trace_dir, "plugins", "profile", "*", "*")
    return sorted(p for p in glob.glob(pattern) if p.endswith((".xplane.pb", ".json.gz")))


class StepProfiler:
    """Traces the steps start..stop-1 of a loop into trace_dir: call step(n, outputs) around each step's
    dispatch (a context manager), then close() (a no-op unless a trace is still open). Every process
    traces its own devices into the same directory (one file per host)."""

    def __init__(self, steps: tuple[int, int] | None, trace_dir: str):
        self.start, self.stop = steps if steps else (None, None)
        self.trace_dir = trace_dir
        self.tracing = False

    @contextlib.contextmanager
    def step(self, step: int, name: str = "train") -> Iterator[None]:
        """Around step `step`'s dispatch: starts the trace at the first traced step, annotates each traced
        one, and stops after the last (see wait_for)."""
        if self.start is None or not self.start <= step < self.stop:
            yield
            return
        if not self.tracing:
            os.makedirs(self.trace_dir, exist_ok=True)
            jax.profiler.start_trace(self.trace_dir, create_perfetto_trace=True)
            self.tracing = True
        with jax.profiler.StepTraceAnnotation(name, step_num=step):
            yield

    def after_step(self, step: int, outputs) -> None:
        """After step `step` was dispatched with these outputs: at the last traced step, wait for them and
        stop the trace, printing where it is and how to open it."""
        if self.tracing and step == self.stop - 1:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stop a trace still open (a run that ended inside the window), and say where it is."""
        if not self.tracing:
            return
        jax.profiler.stop_trace()
        self.tracing = False
        print0(f"Profile of steps {self.start}..{self.stop - 1} in {self.trace_dir}: open it with `xprof --logdir "
               f"{self.trace_dir}` (pip install xprof), or its perfetto_trace.json.gz at https://ui.perfetto.dev")
