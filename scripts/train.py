"""Pretrain a base model: nanochat's base_train.py in JAX.

    python -m scripts.train --depth=20                      # all devices of this host
    python -m scripts.train --depth=4 --max-seq-len=512 --device-batch-size=1 --eval-tokens=512 \
        --core-metric-every=-1 --total-batch-size=512 --num-iterations=20   # a tiny CPU run

The flags are jaxchat.train.settings.RunSettings (every flag of base_train.py keeps its name, default and
meaning; the JAX-only ones are grouped at the end); --recipe picks the nanochat commit whose defaults
apply. Multi-host: start one process per host with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID set (or under SLURM's srun); each process feeds the devices it owns.
"""

from __future__ import annotations  # the library types below are for type checkers: the script imports lazily

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if __name__ == "__main__":  # before JAX is imported (jaxchat.common imports it): glibc reads its tunables at start-up
    from jaxchat.distributed.huge_pages import reexec_with_huge_pages

    reexec_with_huge_pages()

from jaxchat.common import PlatformError, fail, select_platform
from jaxchat.train.settings import RunSettings, SettingsError, parse_settings

if TYPE_CHECKING:
    import grain

    from jaxchat.checkpoint.manager import RunCheckpoints
    from jaxchat.train.profiling import StepProfiler
    from jaxchat.report import Report
    from jaxchat.train.run import Run
    from jaxchat.data.tokenizer import Tokenizer
    from jaxchat.train.loop import LoopPolicy, LoopState, StepLogger
    from jaxchat.train.trainer import TrainState


def main(argv: list[str] | None = None) -> None:
    try:
        settings = parse_settings(argv)  # checked: before JAX starts, any download or device work
    except SettingsError as e:
        fail(str(e))

    from jaxchat.distributed.runtime import apply_gpu_defaults

    gpu_defaults_set = apply_gpu_defaults(settings.device_type)  # XLA flags and memory fraction: before JAX starts

    from jaxchat.distributed.mesh import maybe_initialize_distributed

    maybe_initialize_distributed(settings.heartbeat_timeout)  # before anything touches a device
    from jaxchat.distributed.compilation_cache import enable_compilation_cache
    from jaxchat.distributed.multihost import watch_peers
    from jaxchat.train.loop import EXIT_STOPPED

    try:
        select_platform(settings.device_type)  # before anything starts a backend (--device-type=cpu on a GPU host)
        enable_compilation_cache(settings.compilation_cache)  # before the first compile
        watch_peers()  # (several processes) answers the others from now on, whatever this one is doing
        stopped = train(settings, gpu_defaults_set)
    except Exception as e:
        status = said_error_status(e)
        if status is None:
            raise
        sys.exit(status)
    if stopped:
        sys.exit(EXIT_STOPPED)


def said_error_status(error: BaseException) -> int | None:
    """An error whose message says what to do (the library's) is printed in one line: its exit status. None for
    any other (Python prints its traceback)."""
    from jaxchat.checkpoint.meta import CheckpointError, SaveFailedError
    from jaxchat.data.shards import DataError
    from jaxchat.train.loop import EXIT_SAVE_FAILED

    if isinstance(error, SaveFailedError):
        status = EXIT_SAVE_FAILED
    elif isinstance(error, (SettingsError, CheckpointError, PlatformError, DataError)):
        status = 2  # (bad input, as jaxchat.common.fail)
    else:
        return None
    print(f"error: {error}", file=sys.stderr, flush=True)
    return status


@dataclasses.dataclass
class Session:
    """What the loop and the final report use: built by setup()."""

    settings: RunSettings
    run: Run
    tokenizer: Tokenizer
    token_bytes: Any  # a device array: bytes of each token id
    train_loader: grain.DatasetIterator
    val_loader: Callable  # () -> a fresh validation iterator
    eval_steps: int
    checkpointer: RunCheckpoints
    state: TrainState
    loop: LoopState
    policy: LoopPolicy
    logger: StepLogger
    report: Report | None  # on process 0 only
    wandb_run: Any  # a wandb run, or DummyWandb
    core_results: dict = dataclasses.field(default_factory=dict)


def train(settings: RunSettings, gpu_defaults_set: list[str] | None = None) -> bool:
    """The run; True when a signal stopped it before its last step (its checkpoint saved)."""
    from jaxchat.common import quiet_jax_warnings

    quiet_jax_warnings()
    session = setup(settings, gpu_defaults_set)
    try:
        if session.loop.step == session.run.num_iterations:  # resumed at its last step: trained, evaluated, saved
            from jaxchat.common import print0

            print0(f"Step {session.loop.step} is this run's last and is saved: nothing to train, evaluate or save; "
                   "finishing the report")
            stopped = False
        else:
            stopped = run_loop(session)
        finish(session)  # (its last save completes only with every process)
        return stopped
    except (Exception, KeyboardInterrupt) as e:
        error = e
    # (out of the except block: what finishing the save meets is not taken for a consequence of this error)
    from jaxchat.distributed.multihost import end_after_error

    # (several processes: ends this one, as a lost peer or as its own error)
    end_after_error(error, session.loop.step, lambda: finish_saving(session, error),
                    session.checkpointer.newest_committed_step, said_error_status)
    finish_saving(session, error)
    raise error


def finish_saving(s: Session, error: BaseException) -> None:
    """Before the run ends on an error or a second signal: the checkpoint save under way, if any, is finished,
    so that its step is kept (the error comes after it, as it came); a failure of that save is said in its own
    line. A further signal abandons the save, said in one line."""
    from jaxchat.checkpoint.meta import SaveFailedError

    if isinstance(error, KeyboardInterrupt):
        print("Interrupted: stopping once the checkpoint save under way (if any) is complete; another signal "
              "abandons it", flush=True)
    try:
        s.checkpointer.wait()
    except SaveFailedError as e:
        if not isinstance(error, SaveFailedError):  # (else it is the error itself, said once by main)
            print(f"error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        newest = s.checkpointer.newest_committed_step()
        print(f"error: the checkpoint save under way is abandoned (it is not a step); the newest complete checkpoint: "
              f"{f'step {newest}' if newest is not None else 'none yet'}", file=sys.stderr, flush=True)
        return
    with contextlib.suppress(SaveFailedError):  # (said above) the lock is released all the same
        s.checkpointer.close()


def build(settings: RunSettings, gpu_defaults_set: list[str] | None) -> tuple[Run, Tokenizer, Any]:
    """The run (jaxchat.train.run: mesh, batch arithmetic, horizon, optimizer, state shapes), its tokenizer, and
    the CORE bundle if CORE runs during training, each failing before any training compute."""
    import jax

    from jaxchat.common import print0
    from jaxchat.eval.core import download_eval_bundle
    from jaxchat.distributed.huge_pages import huge_pages_note
    from jaxchat.train.run import build_run, make_layout
    from jaxchat.data.tokenizer import TokenizerError, get_token_bytes, get_tokenizer

    layout = make_layout(settings)  # a batch that does not divide fails before any loading
    device = layout.mesh.devices.flat[0]
    print0(f"jaxchat base training | recipe {settings.recipe} | {jax.process_count()} process(es), "
           f"{layout.mesh.devices.size} {device.platform} device(s) in the mesh ({device.device_kind}) | "
           f"{'FSDP' if settings.fsdp else 'data parallel, ZeRO-1 optimizer state'} | remat {settings.remat}")
    if gpu_defaults_set:
        print0(f"GPU runtime defaults (not set by you): {' '.join(gpu_defaults_set)}")
    print0(f"Compilation cache: {jax.config.jax_compilation_cache_dir or 'off'} (--compilation-cache)")
    if note := huge_pages_note():
        print0(note)
    if settings.fp8 and device.platform != "gpu":  # nanochat ignores --fp8 there; here it runs, for testing
        print0(f"--fp8 on {device.platform}: XLA emulates the fp8 types (slow; fp8 GEMMs need a Hopper GPU or newer)")
    if settings.core_metric_every > 0:  # fetch the eval bundle now rather than fail hours into the run
        try:
            download_eval_bundle()
        except (RuntimeError, OSError) as e:
            fail(f"{e}\nOr train without CORE: --core-metric-every=-1 (then run scripts.base_eval on the checkpoint)")
    try:
        tokenizer, token_bytes = get_tokenizer(), get_token_bytes()
    except (FileNotFoundError, TokenizerError) as e:
        fail(str(e))
    if settings.remat == "auto" and device.platform in ("gpu", "tpu"):  # compiled by XLA, not estimated
        from jaxchat.compiled.remat_choice import resolve_remat_for_run

        settings = resolve_remat_for_run(settings, tokenizer.get_vocab_size(), layout, print0)
    run = build_run(settings, tokenizer.get_vocab_size(), layout=layout, print_fn=print0)
    return run, tokenizer, token_bytes


def make_loaders(settings: RunSettings, run: Run, tokenizer: Tokenizer) -> tuple[grain.DatasetIterator, Callable, int]:
    """This process's share of the data: (train loader, val loader factory, eval steps)."""
    import jax

    from jaxchat.common import print0
    from jaxchat.data.loader import make_train_loader, make_val_loader

    where = (jax.process_index(), jax.process_count())
    local_rows = settings.device_batch_size * sum(d.process_index == where[0] for d in run.mesh.devices.flat)
    try:
        train_loader = make_train_loader(tokenizer, local_rows, settings.max_seq_len, run.grad_accum_steps, *where,
                                         data_dir=settings.corpus_dir, workers=settings.loader_workers)
    except (FileNotFoundError, ValueError) as e:
        fail(str(e))
    eval_steps = settings.eval_tokens // run.tokens_per_micro_batch
    if settings.eval_every > 0 and eval_steps == 0:
        print0(f"warning: --eval-tokens {settings.eval_tokens} is less than one eval batch "
               f"({run.tokens_per_micro_batch} tokens): validation bpb will be inf")

    def val_loader():
        return make_val_loader(tokenizer, local_rows, settings.max_seq_len, *where, steps=eval_steps,
                               data_dir=settings.corpus_dir, workers=settings.loader_workers)

    return train_loader, val_loader, eval_steps


def setup(settings: RunSettings, gpu_defaults_set: list[str] | None) -> Session:
    """Run, data, checkpoints (checked writable before any compute), the state (restored or fresh), logging."""
    import numpy as np

    from jaxchat.checkpoint.manager import RunCheckpoints, check_writable, checkpoint_dir
    from jaxchat.common import DummyWandb, get_base_dir, is_master, peak_flops_per_device, tree_nbytes
    from jaxchat.report import get_report
    from jaxchat.train.loop import LoopPolicy, StepLogger

    if settings.run == "dummy" or not is_master():
        wandb_run = DummyWandb()
    else:
        import wandb  # here, not above: its import is ~0.4 s of every start, and most runs log nothing

        wandb_run = wandb.init(project="jaxchat", name=settings.run, config=settings.user_config())
    run, tokenizer, token_bytes = build(settings, gpu_defaults_set)
    directory = checkpoint_dir(settings.model_tag, settings.depth, get_base_dir())
    check_writable(directory, bytes_needed=tree_nbytes(run.state.params, run.state.opt_state))
    checkpointer = RunCheckpoints(directory, max_to_keep=None if settings.keep_checkpoints < 1 else settings.keep_checkpoints,
                                  lock=not settings.no_lock)
    try:
        # what this start does, decided before any compute: it refuses what would replace steps unasked
        plan = checkpointer.plan_start(settings.resume_from_step, settings.overwrite)
        train_loader, val_loader, eval_steps = make_loaders(settings, run, tokenizer)
        state, loop = start_state(settings, run, tokenizer, checkpointer, plan, train_loader)
        checkpointer.set_aside(plan.set_aside)  # once the weights are read: --init-from may lie among these steps
    except BaseException:
        checkpointer.close()  # a start that fails leaves no run directory behind
        raise
    # What a step line prints: the optimizer's own schedules, computed once for every step
    schedules = run.optimizer.schedules_at(np.arange(run.num_iterations + 1))
    logger = StepLogger(run, peak_flops_per_device(run.mesh.devices.flat[0]), schedules, wandb_run)
    report = get_report(model_tag=os.path.basename(directory)) if is_master() else None  # the curve is the run's
    if report is not None and plan.resume is None:
        report.clear_curve()  # a fresh run starts a new curve; a resumed one continues it
    return Session(run.settings, run, tokenizer, token_bytes, train_loader, val_loader, eval_steps, checkpointer, state,
                   loop, LoopPolicy.from_settings(settings, loop.step), logger, report, wandb_run)


def start_state(settings: RunSettings, run: Run, tokenizer: Tokenizer, checkpointer: RunCheckpoints, plan,
                train_loader: grain.DatasetIterator) -> tuple[TrainState, LoopState]:
    """The state the run starts from, as the plan (RunCheckpoints.plan_start) says: restored, or new (from
    --init-from's weights, if given)."""
    from jaxchat.common import print0
    from jaxchat.export.saved_model import load_init_params
    from jaxchat.train.loop import LoopState

    state = run.init_state()
    if plan.resume is not None:
        if settings.init_from:  # a requeued job: --init-from applied to its first start only
            print0(f"--init-from {settings.init_from} is not used: this run has checkpoints, and resumes from them")
        state.params, state.opt_state, meta = checkpointer.restore(
            plan.resume, state.params, state.opt_state, state.param_shardings, state.opt_shardings,
            data_iter=train_loader, model_config=run.config, tokenizer=tokenizer,
            check_meta=lambda meta: run.check_resume(meta, checkpointer.directory))  # before any array is read
        loop = LoopState.from_meta(meta)
        print0(f"Resumed optimization from step {loop.step}")
        return state, loop
    if settings.init_from:  # the weights only: the optimizer state just made, step 0, the data from its start
        state.params = load_init_params(settings.init_from, run.config, state.params, state.param_shardings,
                                        tokenizer, **run.settings.model_kwargs())
    return state, LoopState()


# -----------------------------------------------------------------------------
# What the loop does besides training steps


def save(s: Session, step: int) -> None:
    from jaxchat.checkpoint.meta import training_meta

    s.logger.write_curve(s.report)
    s.checkpointer.save(step, s.state.params, s.state.opt_state, s.train_loader,
                        training_meta(s.loop.to_meta(), s.run, s.tokenizer))


def evaluate_val(s: Session, step: int) -> None:
    """Validation bpb (every process takes part), into the loop state, the curve and wandb."""
    from jaxchat.common import print0
    from jaxchat.eval.bpb import evaluate_bpb

    s.loop.val_bpb = evaluate_bpb(s.state.model(), s.val_loader(), s.eval_steps, s.token_bytes, s.run.mesh)
    print0(f"Step {step:05d} | Validation bpb: {s.loop.val_bpb:.6f}")
    s.loop.min_val_bpb = min(s.loop.min_val_bpb, s.loop.val_bpb)
    s.logger.curve.append((step, None, s.loop.val_bpb))
    s.logger.write_curve(s.report)
    s.wandb_run.log({"step": step, "total_training_flops": s.run.training_flops(step),
                     "total_training_time": s.loop.total_training_time, "val/bpb": s.loop.val_bpb})


def evaluate_core_metric(s: Session, step: int) -> None:
    from jaxchat.common import print0
    from jaxchat.eval.core import evaluate_core

    s.core_results = evaluate_core(s.state.model(), s.tokenizer, max_per_task=s.settings.core_metric_max_per_task)
    print0(f"Step {step:05d} | CORE metric: {s.core_results['core_metric']:.4f}")
    s.wandb_run.log({"step": step, "total_training_flops": s.run.training_flops(step),
                     "core_metric": s.core_results["core_metric"],
                     "centered_results": s.core_results["centered_results"]})


def sample(s: Session) -> None:
    """Greedy completions of the fixed prompts (every process runs them, so that sharded parameters stay
    usable on several hosts; process 0 prints)."""
    from jaxchat.common import print0
    from jaxchat.model.engine import SAMPLE_PROMPTS, Engine

    engine = Engine(s.state.model(), s.tokenizer)
    for prompt in SAMPLE_PROMPTS:
        tokens, _ = engine.generate_batch(s.tokenizer(prompt, prepend="<|bos|>"), num_samples=1, max_tokens=16,
                                          temperature=0)
        print0(s.tokenizer.decode(tokens[0]))


def run_loop(s: Session) -> bool:
    """num_iterations + 1 passes, so that the last one evaluates and saves; True when a signal stopped it
    before its last step. Each step is sent, then the previous step's loss is read while it runs."""
    from jaxchat.distributed.mesh import batch_sharding
    from jaxchat.train.loop import StopSignals

    batch_spec = batch_sharding(s.run.mesh)
    train_step = s.run.train_step()
    stop = StopSignals(s.run.mesh)
    profiler = make_profiler(s)
    try:
        return train_steps(s, train_step, batch_spec, stop, profiler)
    finally:
        profiler.close()


def make_profiler(s: Session) -> StepProfiler:
    """--profile-steps' tracer, into <base_dir>/profiles/<model tag> (jaxchat.common.local_dir: a local folder
    where the base dir is a bucket); a window this run never reaches is said."""
    from jaxchat.common import local_dir, print0
    from jaxchat.train.profiling import StepProfiler

    window = s.settings.profile_window
    trace_dir = os.path.join(local_dir(), "profiles", os.path.basename(s.checkpointer.directory))
    if window and not s.loop.step <= window[0] < s.run.num_iterations:
        print0(f"--profile-steps {s.settings.profile_steps}: this run trains steps {s.loop.step}.."
               f"{s.run.num_iterations - 1}, so nothing is traced")
    return StepProfiler(window, trace_dir)


def train_steps(s: Session, train_step, batch_spec, stop, profiler: StepProfiler) -> bool:
    """run_loop's loop: each pass does the work due between steps, then sends the next step."""
    from jaxchat.common import print0
    from jaxchat.distributed.mesh import put_batch

    loop, logger, policy = s.loop, s.logger, s.policy
    # each piece of work between steps; the save comes before CORE and samples, so that nothing they do
    # can cost the run its checkpoint
    between_steps = [(policy.eval, evaluate_val), (policy.save, save), (policy.core, evaluate_core_metric),
                     (policy.sample, lambda session, step: sample(session))]
    while True:
        step = loop.step
        last_step = step == s.run.num_iterations
        saved = False
        for rule, work in between_steps:
            if policy.due(rule, step, last_step):
                logger.flush(loop)
                work(s, step)
                saved = saved or rule is policy.save
                logger.restart_clock()
        if logger.stop_agreed and not last_step:  # every process reaches this at the same step
            logger.flush(loop)
            if not saved and step != policy.start_step:
                save(s, step)
            s.checkpointer.wait()
            print0(f"Stopped by a signal after step {step}: checkpoint saved. Resume with --resume-from-step={step}")
            return True
        if last_step:
            return False
        inputs, targets = next(s.train_loader)
        dispatched_at = time.perf_counter()
        with profiler.step(step):
            s.state.params, s.state.opt_state, metrics = train_step(
                s.state.params, s.state.opt_state, put_batch(inputs, batch_spec), put_batch(targets, batch_spec))
        profiler.after_step(step, metrics)
        metrics["stop"] = stop.vote()  # sent with the step, read with its metrics
        logger.flush(loop)
        logger.pending = (step, metrics, dispatched_at, s.train_loader.get_state().get("epoch", 1))
        loop.step += 1


def finish(s: Session) -> None:
    """The last loss line and curve rows, the checkpoints on disk, a few stats and the report's section."""
    import jax

    from jaxchat.common import print0
    from jaxchat.report import Label, Section
    from jaxchat.train.loop import timed_steps

    s.logger.flush(s.loop)
    s.logger.write_curve(s.report)
    s.checkpointer.close()
    loop, run, settings = s.loop, s.run, s.settings
    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peak_memory = max((x.get("peak_bytes_in_use", 0) for x in stats), default=0)
    print0(f"Peak memory usage: {peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "Peak memory usage: n/a (not reported by this backend)")
    print0(f"Total training time: {loop.total_training_time / 60:.2f}m")
    if loop.val_bpb is not None:
        print0(f"Minimum validation bpb: {loop.min_val_bpb:.6f}")
    if s.report is not None:
        timed = timed_steps(loop.step)
        mfu = s.logger.mfu
        s.report.log(section=Section.BASE_TRAINING, data=[
            settings.user_config(),  # CLI args
            {  # stats about the training setup
                Label.PARAMETERS: run.num_params,
                "Number of FLOPs per token": f"{run.flops_per_token:e}",
                "Calculated number of iterations": run.num_iterations,
                Label.TRAINING_TOKENS: run.total_batch_size * run.num_iterations,
                Label.TOKENS_PER_PARAM: run.total_batch_size * run.num_iterations / run.num_params,
                Label.DEVICES: f"{run.mesh.devices.size} x {run.mesh.devices.flat[0].device_kind}",
                "Recipe": f"{settings.recipe} (nanochat {settings.recipe_spec.nanochat_commit})",
                "Total batch size": run.total_batch_size,
                **{name: getattr(settings, name) for name in ("warmup_ratio", "warmup_steps")
                   if settings.recipe_has(name)},
                "warmdown_ratio": settings.warmdown_ratio,
                "final_lr_frac": settings.final_lr_frac,
            },
            {  # stats about training outcomes
                Label.MIN_VAL_BPB: loop.min_val_bpb if loop.val_bpb is not None else None,
                "Final validation bpb": loop.val_bpb,
                Label.CORE_TRAINING: s.core_results.get("core_metric", None),
                Label.MFU: f"{mfu:.2f}%" if mfu is not None else "n/a",
                "Total training flops": f"{run.training_flops(loop.step):e}",
                Label.TRAINING_TIME: f"{loop.total_training_time / 60:.2f}m",
                Label.TOK_PER_SEC: round(run.total_batch_size * timed / loop.total_training_time)
                if timed > 0 and loop.total_training_time > 0 else "n/a",
                Label.PEAK_MEMORY: f"{peak_memory / 1024 / 1024:.2f}MiB" if peak_memory else "n/a",
            },
        ])
    s.wandb_run.finish()


if __name__ == "__main__":
    main()
