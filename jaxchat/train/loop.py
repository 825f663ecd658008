"""The training loop's policy, each rule once: when to evaluate, save, run CORE and sample (one "every N
steps" rule), which steps are timed, what a step line prints, what the loop carries between steps and
saves in every checkpoint, how a signal stops it (every process at the same step) and with which exit
status, what a lost or failed peer process ends it with. scripts.train runs the loop.

The step loop runs num_iterations + 1 times (as base_train.py): the last pass only evaluates and saves.
"""

import dataclasses
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxchat.checkpoint.meta import CheckpointMismatchError
from jaxchat.common import print0
from jaxchat.distributed.mesh import DATA_AXIS

# Exit status of a run stopped by SIGTERM/SIGINT after saving its checkpoint (EX_TEMPFAIL of sysexits.h):
# the run is not finished; the same command with --resume-from-step=latest carries it on. 0: finished.
EXIT_STOPPED = 75
# Exit status of a run whose checkpoint could not be written (no space, permission lost; EX_IOERR): the
# previous complete step is intact, and --resume-from-step=latest carries on once the disk is fixed.
EXIT_SAVE_FAILED = 74
EMA_BETA = 0.9  # smoothing of the printed training loss
# Steps 0..TIMING_WARMUP_STEPS compile and warm up: their time is left out of total_training_time, the
# ETA and the average tok/s (as base_train.py's `step > 10`)
TIMING_WARMUP_STEPS = 10


def timed_steps(steps_done: int) -> int:
    """How many of the steps 0..steps_done-1 count in total_training_time."""
    return max(0, steps_done - (TIMING_WARMUP_STEPS + 1))


@dataclasses.dataclass
class LoopState:
    """What the loop carries from step to step besides the arrays; saved in every checkpoint's meta."""

    step: int = 0
    val_bpb: float | None = None  # the last validation bpb
    min_val_bpb: float = float("inf")
    smooth_train_loss: float = 0.0  # EMA of the training loss (debiased when printed)
    total_training_time: float = 0.0  # seconds of the timed steps (timed_steps)

    def to_meta(self) -> dict:
        """nanochat's checkpoint fields: step, val_bpb and the rest as loop_state."""
        return {"step": self.step, "val_bpb": self.val_bpb,
                "loop_state": {"min_val_bpb": self.min_val_bpb, "smooth_train_loss": self.smooth_train_loss,
                               "total_training_time": self.total_training_time}}

    @classmethod
    def from_meta(cls, meta: dict, where: str = "the checkpoint's meta") -> "LoopState":
        """The state to_meta saved; CheckpointMismatchError, one line naming `where` (the meta file), if any of
        it is missing (scripts.train saves all of it: a file another program wrote or cut)."""
        fields = cls().to_meta()
        missing = [key for key in fields if key not in meta]
        if "loop_state" not in missing:
            missing += [f"loop_state.{key}" for key in fields["loop_state"] if key not in (meta["loop_state"] or {})]
        if missing:
            raise CheckpointMismatchError(
                f"{where} lacks {', '.join(missing)}, the training loop's state that a resumed run continues from: "
                "restore that file, resume another step (--resume-from-step N), or start a new run from these "
                "weights with --init-from <that step's directory> --model-tag <a new tag>")
        return cls(step=meta["step"], val_bpb=meta["val_bpb"],
                   **{key: meta["loop_state"][key] for key in fields["loop_state"]})


@dataclasses.dataclass(frozen=True)
class Every:
    """One "every N steps" rule (N <= 0: never). Due at the last step, and at every multiple of N except the
    step this process started from: a fresh run's step 0 (only with at_step_0: the untrained baseline), or
    the resumed step, whose evaluation, save, CORE and samples the run that saved it has done already.
    always_last: due at the last step even with N <= 0 (the final checkpoint)."""

    n: int
    at_step_0: bool = False
    always_last: bool = False

    def due(self, step: int, *, last_step: bool, start_step: int) -> bool:
        if last_step:
            return self.always_last or self.n > 0
        if self.n <= 0 or step % self.n:
            return False
        return step != start_step or (step == 0 and self.at_step_0)


@dataclasses.dataclass(frozen=True)
class LoopPolicy:
    """When the loop evaluates, saves, runs CORE and samples (base_train.py's four rules, as Every)."""

    start_step: int
    eval: Every
    save: Every
    core: Every
    sample: Every

    @classmethod
    def from_settings(cls, settings, start_step: int) -> "LoopPolicy":
        return cls(start_step=start_step,
                   eval=Every(settings.eval_every, at_step_0=True),
                   save=Every(settings.save_every, always_last=True),
                   core=Every(settings.core_metric_every),
                   sample=Every(settings.sample_every))

    def due(self, rule: Every, step: int, last_step: bool) -> bool:
        return rule.due(step, last_step=last_step, start_step=self.start_step)


class StopSignals:
    """SIGTERM / SIGINT on any process: every process stops at the same step, saves it and exits with
    EXIT_STOPPED; a second signal stops this process at once (KeyboardInterrupt), without a checkpoint of its
    own: scripts.train finishes a save already under way first, and a third signal abandons that.

    A signal reaches the processes of a job at different moments, or only some of them, so no process
    stops on its own: each step carries every process's "stop requested" flag into a tiny all-reduce
    (vote), and its result comes back with that step's metrics, one step late (StepLogger.flush). Every
    process reads the same result at the same point of the loop, so all agree on the step to stop at
    without a host sync of their own."""

    def __init__(self, mesh: Mesh):
        self.received: list[int] = []
        devices = mesh.devices.flat
        self._local_devices = sum(d.process_index == jax.process_index() for d in devices)
        self._sharding = NamedSharding(mesh, P(DATA_AXIS))
        self._any = jax.jit(jnp.max, out_shardings=NamedSharding(mesh, P()))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        where = f" by process {jax.process_index()}" if jax.process_count() > 1 else ""
        print(f"Signal {signum} received{where}: stopping at a step every process agrees on, then saving a "
              "checkpoint (a second signal stops at once, finishing only a save under way)", flush=True)
        self.received.append(signum)

    def vote(self) -> jax.Array:
        """This step's vote: 1 (a device scalar, replicated) if any process has received a signal."""
        local = np.full((self._local_devices,), bool(self.received), np.int32)
        return self._any(jax.make_array_from_process_local_data(self._sharding, local))


class StepLogger:
    """nanochat's step line, read one step late: the device runs the next step while the host reads
    this one's loss. Keeps the loss EMA and the timing in the LoopState, and the report's curve rows.
    run: a jaxchat.train.run.Run (horizon, FLOPs, batch size); schedules: the optimizer's, for every step."""

    def __init__(self, run, peak_flops: float | None, schedules: dict, wandb_run):
        self.run, self.peak_flops, self.schedules, self.wandb_run = run, peak_flops, schedules, wandb_run
        self.pending = None  # (step, metrics, dispatched_at, epoch) not read yet
        self.stop_agreed = False  # the stop vote of the newest step read (StopSignals): the same on every process
        self.curve = []  # (step, loss, val_bpb) rows for the report's CSV, not written yet
        self.mfu = None
        self.restart_clock()

    def restart_clock(self) -> None:
        """After work that is not training (evaluation, sampling): the next step's time starts now."""
        self.last_done = time.perf_counter()

    def write_curve(self, report) -> None:
        """Append the new rows to the run's <base_dir>/report/training_curve_<tag>.csv (at evals and saves, so
        the curve on disk always reaches the newest checkpoint and a resumed run carries it on)."""
        if report is not None:
            report.append_curve(self.curve)
        self.curve.clear()

    def flush(self, loop: LoopState) -> None:
        """Read the pending step's loss (blocks until it is done) and print its line."""
        if self.pending is None:
            return
        s, metrics, dispatched_at, epoch = self.pending
        self.pending = None
        loss = float(metrics["loss"])
        self.stop_agreed = self.stop_agreed or bool(metrics.get("stop", False))
        now = time.perf_counter()
        dt = now - max(self.last_done, dispatched_at)  # device time of step s: since s-1 finished, or since s was sent
        self.last_done = now
        loop.smooth_train_loss = EMA_BETA * loop.smooth_train_loss + (1 - EMA_BETA) * loss
        smooth = loop.smooth_train_loss / (1 - EMA_BETA ** (s + 1))
        total_batch_size, num_iterations = self.run.total_batch_size, self.run.num_iterations
        tok_per_sec = int(total_batch_size / dt)
        flops_per_sec = self.run.flops_per_token * total_batch_size / dt
        world = self.run.mesh.devices.size
        self.mfu = 100 * flops_per_sec / (self.peak_flops * world) if self.peak_flops else None
        eta = ""
        if timed_steps(s + 1):
            loop.total_training_time += dt
            eta = f" | eta: {(num_iterations - s) * loop.total_training_time / timed_steps(s + 1) / 60:.1f}m"
        mfu = f"{self.mfu:.2f}" if self.mfu is not None else "n/a"
        lrm, momentum, decay = (self.schedules[k][s] for k in ("lrm", "muon_momentum", "weight_decay"))
        # nanochat's line, with the Muon schedules (which differ by recipe) after the lr multiplier
        print0(f"step {s:05d}/{num_iterations:05d} ({100 * s / num_iterations:.2f}%) | loss: {smooth:.6f} | "
               f"lrm: {lrm:.2f} | mom: {momentum:.3f} | wd: {decay:.2e} | dt: {dt * 1000:.2f}ms | tok/sec: {tok_per_sec:,} | mfu: {mfu} | epoch: {epoch} | "
               f"total time: {loop.total_training_time / 60:.2f}m{eta}")
        self.curve.append((s, smooth, None))
        if s % 100 == 0:
            self.wandb_run.log({
                "step": s,
                "total_training_flops": self.run.training_flops(s),
                "total_training_time": loop.total_training_time,
                "train/loss": smooth,
                "train/lrm": float(lrm),
                "train/muon_momentum": float(momentum),
                "train/weight_decay": float(decay),
                "train/dt": dt,
                "train/tok_per_sec": tok_per_sec,
                "train/epoch": epoch,
                **({"train/mfu": self.mfu} if self.mfu is not None else {}),  # unknown peak (a CPU): not logged as 0
            })
